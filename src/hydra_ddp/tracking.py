"""Per-rank training stats: local JSON lines always, Weights & Biases optionally.

Every rank calls `Tracker.log` at each log interval with the same stat keys. The tracker does
one small all_gather of those stats so rank 0 can derive cross-rank aggregates (which rank is
the straggler, how long ranks wait for data). The gather is asynchronous and completes at the
next log point (or at `close`), so training does not stall at every interval. Then:

* every rank appends its own stats to ``<output_dir>/stats/rank{r}.jsonl``;
* rank 0 appends the aggregates to ``<output_dir>/stats/aggregate.jsonl`` (and, from
  `log_eval` / `summary`, ``eval.jsonl`` / ``summary.json``);
* with ``logger.backend=wandb`` the stats also go to W&B in one of the three layouts W&B
  documents for distributed training:

  ``gather``  rank 0 owns the only run and logs ``rank{r}/<stat>`` for every rank plus
              ``agg/<stat>``;
  ``group``   one run per rank (``job_type=rank{r}``), grouped per job; each run logs its own
              stats as ``train/<stat>`` (so the UI can average a key across the group) and
              rank 0's run also logs ``agg/<stat>``;
  ``shared``  every rank writes into one run (W&B's experimental shared mode, online only):
              ``rank{r}/<stat>`` from each rank, ``agg/<stat>`` from rank 0.

  Training rows go to W&B at most once per ``logger.min_interval_s`` (the newest row wins;
  the last one is sent at close); the JSON-lines files keep every interval.

  All keys are plotted against ``trainer/step`` (set with ``define_metric``), never against
  W&B's internal ``_step``, so eval rows and train rows share one x axis.

W&B runs live under ``<output_dir>/wandb`` so an offline run can be uploaded later with
``wandb sync <output_dir>/wandb/offline-run-*``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, TextIO

import torch
import torch.distributed as dist

from hydra_ddp.config import Layout, LoggerBackend, LoggerConfig, WandbMode
from hydra_ddp.errors import UserError

if TYPE_CHECKING:  # wandb is imported lazily: logger.backend=none must not import it at all
    from wandb import Run

    from hydra_ddp.dist import DistEnv

logger = logging.getLogger(__name__)

STEP_METRIC = "trainer/step"
# Stats whose spread across ranks is aggregated as <stat>_min/_mean/_max plus the argmax rank.
_SPREAD_STATS = ("step_time", "data_wait")
# W&B rejects longer groups/names/job types.
_WANDB_MAX_LEN = 128
# Config keys that name a credential (``api_key``, ``hf_token``; not ``tokenizer``).
_SECRET_KEY = re.compile(r"(?:^|[_.-])(?:api_?key|token|secret|password|passwd)$", re.IGNORECASE)
_REDACTED = "<redacted>"


@dataclass
class RunInfo:
    """What the tracker needs to know about the job it records."""

    output_dir: Path  # the job's output dir, shared by all ranks
    job_name: str  # e.g. "model=cnn,sampler=sharded" in a sweep, or "train"
    group: str  # one per sweep (or per job when not sweeping)
    config: dict  # the resolved config as plain containers (the run's W&B config)


# --------------------------------------------------------------------------------------------
# W&B mode resolution (no network, no prompt)
# --------------------------------------------------------------------------------------------

_ENV_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}


def wandb_credentials_source() -> Optional[str]:
    """Where W&B would find credentials on this machine, or None when there are none.

    The places W&B documents: ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, and the
    ``.netrc`` entry (``$NETRC`` or ``~/.netrc``) that ``wandb login`` writes for the W&B host
    (``WANDB_BASE_URL``, default api.wandb.ai). Only local files are read: it never prompts and
    never contacts the server, so a key's validity is not checked here. Returns a short
    description of the source, never the key itself.
    """
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    return "netrc" if _netrc_has_wandb_host() else None


def _netrc_has_wandb_host() -> bool:
    import netrc
    from urllib.parse import urlsplit

    path = Path(os.environ.get("NETRC", "~/.netrc")).expanduser()
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    try:
        return bool(netrc.netrc(str(path)).authenticators(host))
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_mode(mode: WandbMode) -> tuple[str, str]:
    """Turn ``logger.mode`` into W&B's mode and a human-readable reason for the choice.

    ``auto`` honours an explicit ``WANDB_MODE`` / ``WANDB_DISABLED`` in the environment, else
    goes online exactly when W&B credentials exist locally (see `wandb_credentials_source`).
    """
    if mode != WandbMode.auto:
        return mode.value, f"logger.mode={mode.value}"
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled", "WANDB_DISABLED is set"
    env_mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if env_mode in _ENV_MODES:
        return _ENV_MODES[env_mode], f"WANDB_MODE={env_mode}"
    source = wandb_credentials_source()
    if source is None:
        return "offline", (
            "logger.mode=auto found no W&B login: no WANDB_API_KEY and no netrc entry"
        )
    return "online", f"logger.mode=auto found W&B credentials in {source}"


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _json_number(value: float) -> Optional[float]:
    """JSON has no NaN/inf; write them as null so every JSON reader can load the file."""
    return value if math.isfinite(value) else None


def _clip(text: str, limit: int = _WANDB_MAX_LEN) -> str:
    """Shorten over-long W&B names while keeping distinct inputs distinct."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    return f"{text[: limit - 9]}-{digest}"


def _redact(value: Any, secret: Optional[str]) -> Any:
    """Copy of a config with secret-looking entries (and the live API key) blanked."""
    if isinstance(value, Mapping):
        return {
            k: (
                _REDACTED
                if isinstance(k, str) and _SECRET_KEY.search(k) and v
                else _redact(v, secret)
            )
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_redact(v, secret) for v in value]
    if isinstance(value, str) and secret and secret in value:
        return value.replace(secret, _REDACTED)
    return value


def shared_run_id(cfg: LoggerConfig, run: RunInfo) -> str:
    """The W&B run id every rank of a shared-layout job uses, agreed without communication.

    Everything hashed is identical on all ranks: the job's output dir, name and group, plus
    the launcher's job id (torchrun's run id / SLURM's job and step) and the elastic restart
    count, so a restarted worker group opens a fresh run rather than colliding with the
    finished one.
    """
    parts = [cfg.entity or "", cfg.project, str(run.output_dir), run.job_name, run.group]
    parts += [
        os.environ.get(k, "")
        for k in (
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT",
            "SLURM_JOB_ID",
            "SLURM_STEP_ID",
        )
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _aggregate(table: Dict[int, List[float]], keys: List[str]) -> Dict[str, float]:
    """Cross-rank aggregates of one log interval; ``table`` maps rank -> values in key order."""
    agg: Dict[str, float] = {}
    columns = {k: {r: row[i] for r, row in table.items()} for i, k in enumerate(keys)}
    for name in _SPREAD_STATS:
        per_rank = {r: v for r, v in columns.get(name, {}).items() if math.isfinite(v)}
        if not per_rank:
            continue
        values = list(per_rank.values())
        agg[f"{name}_min"] = min(values)
        agg[f"{name}_mean"] = sum(values) / len(values)
        agg[f"{name}_max"] = max(values)
        slowest = max(per_rank, key=lambda r: per_rank[r])
        agg["slowest_rank" if name == "step_time" else f"{name}_slowest_rank"] = float(slowest)
    if "samples_per_s" in columns:
        # The job's throughput: ranks process disjoint samples in parallel.
        agg["samples_per_s_total"] = sum(columns["samples_per_s"].values())
    if "loss" in columns:
        agg["loss_mean"] = sum(columns["loss"].values()) / len(table)
    return agg


# --------------------------------------------------------------------------------------------
# The tracker
# --------------------------------------------------------------------------------------------


@dataclass
class _Interval:
    """One log interval's stats on this rank, and its all_gather while in flight."""

    step: int
    keys: List[str]
    values: List[float]
    time: float
    signature: float = 0.0
    parts: List[torch.Tensor] = field(default_factory=list)
    work: Optional[Any] = None  # the async all_gather's handle; None when not distributed


class Tracker:
    """Records one job's per-rank stats locally and (optionally) in W&B. See the module doc."""

    def __init__(self, cfg: LoggerConfig, env: DistEnv, run: RunInfo) -> None:
        # Every attribute close() touches exists before anything can fail.
        self._cfg = cfg
        self._env = env
        self._info = run
        self._closed = False
        self._own: Optional[TextIO] = None
        self._agg: Optional[TextIO] = None
        self._eval: Optional[TextIO] = None
        self._run: Optional[Run] = None
        self._layout = cfg.layout
        self._wandb_mode = "disabled"
        self._pending: Optional[_Interval] = None
        self._last_sent = -math.inf  # time.monotonic() of the last training row sent to W&B
        self._unsent: Optional[Dict[str, float]] = None
        # (step, aggregates) of the newest interval whose gather completed, on rank 0.
        self.last_aggregate: tuple[int, Dict[str, float]] = (0, {})

        if cfg.backend == LoggerBackend.wandb:
            self._wandb_mode, reason = resolve_mode(cfg.mode)
            # Checked on every rank before any collective, so all ranks fail alike and fast.
            if cfg.layout == Layout.shared and self._wandb_mode == "offline":
                raise UserError(
                    f"logger.layout=shared needs W&B online ({reason}); use logger.layout="
                    "gather or group, or log in (`wandb login` or WANDB_API_KEY)"
                )
            logger.info("W&B mode %s (%s), layout %s", self._wandb_mode, reason, cfg.layout.value)

        try:
            self._stats_dir = Path(run.output_dir) / "stats"
            self._stats_dir.mkdir(parents=True, exist_ok=True)
            # Append: a resumed job continues the same files.
            self._own = open(self._stats_dir / f"rank{env.rank}.jsonl", "a", encoding="utf-8")
            if env.is_main:
                self._agg = open(self._stats_dir / "aggregate.jsonl", "a", encoding="utf-8")
            if cfg.backend == LoggerBackend.wandb and self._wandb_mode != "disabled":
                self._run = self._start_wandb()
        except BaseException:
            self.close(failed=True)
            raise

    # ---------------------------------------------------------------------------- W&B setup

    def _wandb_writes(self) -> bool:
        """Whether this rank owns a W&B run (all layouts but gather log from every rank)."""
        return self._env.is_main or self._layout != Layout.gather

    def _start_wandb(self) -> Optional[Run]:
        if not self._wandb_writes():
            return None
        import wandb

        cfg, env, info = self._cfg, self._env, self._info
        name = cfg.name or info.job_name
        group = cfg.group or info.group
        settings: Dict[str, Any] = {
            "mode": self._wandb_mode,
            # Hydra's basic launcher runs a sweep's jobs one after another in one process:
            # each job must get a fresh run even if a previous job never closed its tracker.
            "reinit": "finish_previous",
            # One rank talking is enough; the others' runs still record everything.
            "silent": not env.is_main,
            # No sparkline wall of every key at the end: the job prints its own summary.
            "quiet": True,
            "console": cfg.console.value,
        }
        kwargs: Dict[str, Any] = {}
        if self._layout == Layout.group:
            # Ranks of different jobs in one sweep must not share a group.
            group = f"{group}-{info.job_name}"
            name = f"{name}-rank{env.rank}"
            kwargs["job_type"] = f"rank{env.rank}"
            settings["x_label"] = f"rank{env.rank}"
        elif self._layout == Layout.shared:
            kwargs["id"] = shared_run_id(cfg, info)
            settings.update(
                mode="shared",
                x_label=f"rank{env.rank}",
                x_primary=env.is_main,
                # Only the primary decides whether the run finished or failed.
                x_update_finish_state=env.is_main,
            )
        if self._layout != Layout.gather and env.device.type == "cuda":
            # System stats of this rank's own GPU only; gather's single run watches them all.
            index = env.device.index if env.device.index is not None else env.local_rank
            settings["x_stats_gpu_device_ids"] = [index]

        out = Path(info.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = _redact(info.config, os.environ.get("WANDB_API_KEY"))
        try:
            wb_run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=_clip(name),
                group=_clip(group),
                tags=[_clip(t, 64) for t in dict.fromkeys(cfg.tags)],
                config=config,
                dir=str(out),
                settings=wandb.Settings(**settings),
                **kwargs,
            )
        except (wandb.errors.AuthenticationError, wandb.errors.UsageError) as e:
            raise UserError(
                f"W&B could not start a run for logger.project={cfg.project!r} "
                f"({str(e).splitlines()[0]}): check logger.* and your W&B login, "
                "or set logger.mode=offline"
            ) from None

        wb_run.define_metric(STEP_METRIC)
        if self._layout == Layout.group:
            families = ["train/*"]
        else:
            # W&B globs only match a trailing '*', hence one pattern per rank.
            families = (
                [f"rank{r}/*" for r in range(env.world_size)]
                if env.is_main
                else [f"rank{env.rank}/*"]
            )
        if env.is_main:
            families += ["agg/*", "val/*", "test/*"]
        for pattern in families:
            wb_run.define_metric(pattern, step_metric=STEP_METRIC)
        logger.info("W&B run %s (%s) in %s", wb_run.id, self._wandb_mode, out / "wandb")
        return wb_run

    # ---------------------------------------------------------------------------- logging

    def _start_gather(
        self, step: int, keys: List[str], values: List[float], now: float
    ) -> _Interval:
        """Start one all_gather of [key signature, *values] from every rank (float64)."""
        interval = _Interval(step, keys, values, now)
        if not self._env.distributed:
            return interval
        # A hash of the key names rides along so mismatched keys fail loudly, not silently
        # mislabelled; crc32 fits a float64 exactly.
        interval.signature = float(zlib.crc32("\0".join(keys).encode()))
        local = torch.tensor(
            [interval.signature, *values], dtype=torch.float64, device=self._env.device
        )
        interval.parts = [torch.empty_like(local) for _ in range(self._env.world_size)]
        # Asynchronous: the result is read at the next log point (or at close), so the
        # collective overlaps the next steps instead of stalling every rank at each interval.
        interval.work = dist.all_gather(interval.parts, local, async_op=True)
        return interval

    def _finish(self, interval: _Interval) -> None:
        """Wait for an interval's gather; write its aggregates (rank 0) and W&B row."""
        keys, values, step = interval.keys, interval.values, interval.step
        if interval.work is None:
            table = {self._env.rank: values}
        else:
            interval.work.wait()
            rows = torch.stack(interval.parts).cpu().tolist()
            if any(row[0] != interval.signature for row in rows):
                # Every rank sees every signature, so all ranks raise here together.
                raise RuntimeError(
                    f"Tracker.log at step {step}: ranks passed different stat "
                    "keys; every rank must log the same keys at every interval"
                )
            table = {r: row[1:] for r, row in enumerate(rows)}
        agg = _aggregate(table, keys) if self._env.is_main else {}
        if self._env.is_main:
            self._append(self._agg, {"step": step, "time": interval.time, **agg})
            self.last_aggregate = (step, agg)
        if self._run is None:
            return
        row: Dict[str, float] = {STEP_METRIC: step}
        if self._layout == Layout.gather:
            for r, vals in table.items():
                row.update({f"rank{r}/{k}": v for k, v in zip(keys, vals)})
        elif self._layout == Layout.group:
            row.update({f"train/{k}": v for k, v in zip(keys, values)})
        else:
            row.update({f"rank{self._env.rank}/{k}": v for k, v in zip(keys, values)})
        row.update({f"agg/{k}": v for k, v in agg.items()})
        now = time.monotonic()
        if now - self._last_sent >= self._cfg.min_interval_s:
            self._run.log(row)
            self._last_sent, self._unsent = now, None
        else:
            self._unsent = row  # sent at close if no later row replaces it

    def log(self, step: int, stats: Dict[str, float]) -> None:
        """Record this rank's stats for ``step``. Collective: call on every rank, same keys.

        This rank's own line is written at once. The cross-rank part (rank 0's aggregates,
        the W&B row) completes at the next call or at `close`: see `last_aggregate`.
        """
        if self._closed:
            raise RuntimeError("Tracker.log called after close()")
        keys = sorted(stats)
        values = [float(stats[k]) for k in keys]
        now = time.time()
        # Integers (samples_seen, data_bytes, ...) stay integers in the local copy.
        own = {k: stats[k] if type(stats[k]) is int else v for k, v in zip(keys, values)}
        self._append(self._own, {"step": step, "time": now, "rank": self._env.rank, **own})
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._finish(pending)
        interval = self._start_gather(step, keys, values, now)
        if interval.work is None:
            self._finish(interval)
        else:
            self._pending = interval

    def log_eval(self, step: int, metrics: Dict[str, float]) -> None:
        """Record evaluation metrics keyed like ``val/acc`` or ``test/loss`` (rank 0 only)."""
        if not self._env.is_main or self._closed:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        if self._eval is None:
            self._eval = open(self._stats_dir / "eval.jsonl", "a", encoding="utf-8")
        self._append(self._eval, {"step": step, "time": time.time(), **metrics})
        if self._run is not None:
            self._run.log({STEP_METRIC: step, **metrics})

    def summary(self, metrics: Dict[str, float]) -> None:
        """Set final values (e.g. best ``val/acc``) on the run's summary (rank 0 only)."""
        if not self._env.is_main or self._closed:
            return
        path = self._stats_dir / "summary.json"
        merged: Dict[str, Any] = {}
        if path.exists():
            try:
                merged = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                logger.warning("could not read %s; rewriting it", path)
        merged.update({k: _json_number(float(v)) for k, v in metrics.items()})
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
        if self._run is not None:
            self._run.summary.update(dict(metrics))

    def close(self, failed: bool = False) -> None:
        """Complete the last interval, finish the W&B run (exit code 1 when ``failed``) and
        close the files. Idempotent. Not collective, but on success every rank must call it
        (the last interval's gather is waited for)."""
        if self._closed:
            return
        error: Optional[BaseException] = None
        pending, self._pending = self._pending, None
        # After a failure a peer may be gone: only an interval already gathered is kept.
        if pending is not None and (not failed or pending.work.is_completed()):
            try:
                self._finish(pending)
            except Exception as e:  # still finish the run and close the files
                error, failed = e, True
        self._closed = True
        run, self._run = self._run, None
        if run is not None:
            try:
                if self._unsent is not None:
                    run.log(self._unsent)
                run.finish(exit_code=1 if failed else 0)
            except Exception:  # closing must not mask the error that made us close
                logger.exception("could not finish W&B run %s", run.id)
            if self._wandb_mode == "offline" and self._env.is_main:
                logger.info(
                    "W&B offline run saved; upload it later with `wandb sync %s`",
                    Path(run.dir).parent,
                )
        for attr in ("_own", "_agg", "_eval"):
            handle = getattr(self, attr)
            setattr(self, attr, None)
            if handle is not None:
                handle.close()
        if error is not None:
            raise error

    @staticmethod
    def _append(handle: Optional[TextIO], record: Dict[str, Any]) -> None:
        if handle is None:
            return
        clean = {k: (_json_number(v) if isinstance(v, float) else v) for k, v in record.items()}
        handle.write(json.dumps(clean, allow_nan=False) + "\n")
        handle.flush()  # a crashed or killed rank still leaves its stats up to the last interval


def make_tracker(cfg: LoggerConfig, env: DistEnv, run: RunInfo) -> Tracker:
    """Build the tracker for one job (``logger.backend=none`` keeps W&B out entirely)."""
    return Tracker(cfg, env, run)
