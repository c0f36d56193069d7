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

One job, one set of W&B runs, across restarts: the run ids (one per layout, or one per rank for
``group``) are derived from the output dir and recorded, with the runs' names and groups, in
``<output_dir>/wandb_ids.json`` by rank 0. A job that resumed from a checkpoint in that dir
(``resumed_step`` given) reopens the recorded runs with ``wandb.init(id=..., resume="allow")``
and sends W&B only the rows after the newest step it already sent (read back from the local
``stats/*.jsonl``, which are always written before W&B gets a row), so no step is logged twice
or rewound. A job that starts from step 0 in a dir that has recorded runs gets new ids. See
docs/wandb_resume.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import shlex
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, TextIO

import torch
import torch.distributed as dist

from hydra_ddp import jsonfile, redact
from hydra_ddp.config import Layout, LoggerBackend, LoggerConfig, WandbMode
from hydra_ddp.dist import all_gather_objects
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
# The longest W&B reason quoted in an error line.
_REASON_MAX_LEN = 200
# Where the job's W&B run ids are recorded, in its output dir.
IDS_FILE = "wandb_ids.json"
_STEP_FIELD = re.compile(r'^\{"step": (-?\d+)[,}]')


@dataclass
class RunInfo:
    """What the tracker needs to know about the job it records."""

    output_dir: Path  # the job's output dir, shared by all ranks
    job_name: str  # e.g. "model=cnn,sampler=sharded" in a sweep, or "train"
    group: str  # one per sweep (or per job when not sweeping)
    config: dict  # the resolved config as plain containers (the run's W&B config)
    overrides: List[str] = field(default_factory=list)  # the job's command-line overrides


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

    The places W&B reads: ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, and the netrc
    entry (``$NETRC``, ``~/.netrc`` or ``~/_netrc``) that ``wandb login`` writes for the W&B
    host: ``WANDB_BASE_URL``, else the ``base_url`` that ``wandb login --host`` saved in W&B's
    settings file (``$WANDB_CONFIG_DIR/settings``, default ``~/.config/wandb/settings``, or
    ``./wandb/settings``), else api.wandb.ai. Only local files are read: it never prompts and
    never contacts the server, so a key's validity is not checked here. Returns a short
    description of the source, never the key itself.
    """
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    host, where = wandb_host()
    found = _netrc_entry(host)
    return f"{found} for {host} ({where})" if found else None


def wandb_host() -> tuple[str, str]:
    """The W&B server host W&B itself would use, and which setting named it."""
    from urllib.parse import urlsplit

    url, where = os.environ.get("WANDB_BASE_URL"), "WANDB_BASE_URL"
    if not url:
        import configparser

        config_dir = Path(os.environ.get("WANDB_CONFIG_DIR", "~/.config/wandb")).expanduser()
        for path in (Path("wandb") / "settings", config_dir / "settings"):
            parser = configparser.ConfigParser()
            try:
                parser.read(path)
            except configparser.Error:
                continue
            if parser.has_option("default", "base_url"):
                url, where = parser.get("default", "base_url"), str(path)
                break
    if not url:
        url, where = "https://api.wandb.ai", "the default host"
    return urlsplit(url if "//" in url else f"https://{url}").netloc, where


def _netrc_entry(host: str) -> Optional[str]:
    import netrc

    paths = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for name in paths:
        path = Path(name).expanduser()
        try:
            if netrc.netrc(str(path)).authenticators(host):
                return f"{path.name}"
        except (FileNotFoundError, netrc.NetrcParseError, OSError):
            continue
    return None


def resolve_mode(mode: WandbMode) -> tuple[str, str]:
    """Turn ``logger.mode`` into W&B's mode and a human-readable reason for the choice.

    ``auto`` honours an explicit ``WANDB_MODE`` / ``WANDB_DISABLED`` in the environment, else
    goes online exactly when W&B credentials exist locally (see `wandb_credentials_source`).
    """
    if mode == WandbMode.online and wandb_credentials_source() is None:
        # W&B would ask for a key on a terminal and wait forever (or fail on every rank).
        host, where = wandb_host()
        raise UserError(
            f"logger.mode=online but W&B has no login for {host} (from {where}): run `wandb "
            "login` (or set WANDB_API_KEY), or use logger.mode=offline / auto"
        )
    if mode != WandbMode.auto:
        return mode.value, f"logger.mode={mode.value}"
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled", "WANDB_DISABLED is set"
    env_mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if env_mode in _ENV_MODES:
        return _ENV_MODES[env_mode], f"WANDB_MODE={env_mode}"
    source = wandb_credentials_source()
    if source is None:
        host, _ = wandb_host()
        return "offline", (
            f"logger.mode=auto found no W&B login: no WANDB_API_KEY and no netrc entry for {host}"
        )
    return "online", f"logger.mode=auto found W&B credentials in {source}"


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _clip(text: str, limit: int = _WANDB_MAX_LEN) -> str:
    """Shorten over-long W&B names while keeping distinct inputs distinct."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    return f"{text[: limit - 9]}-{digest}"


def _shorten(text: str, limit: int = 60, quote: bool = False) -> str:
    """A value quoted in an error message: long ones cut, with their length."""
    if len(text) <= limit:
        return repr(text) if quote else text
    head = repr(text[:limit]) if quote else text[:limit]
    return f"{head}... ({len(text)} characters)"


def _append_to(path: Path) -> TextIO:
    """Open a JSON-lines file to append to, first dropping a last line that a crash cut short
    (appending to it would make both it and the next record unreadable)."""
    if path.is_file():
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                f.truncate(keep)
                logger.warning(
                    "%s ended in a partial record (%d bytes, cut short by a crash): dropped",
                    path,
                    len(data) - keep,
                )
    return open(path, "a", encoding="utf-8")


def _for_wandb(value: Any) -> Any:
    """Text as preformatted HTML (a plain string is no W&B chart); the rest as it is."""
    if isinstance(value, str):
        import html

        import wandb

        return wandb.Html(f"<pre>{html.escape(value)}</pre>")
    return value


def physical_gpu(index: int) -> int:
    """The GPU id W&B's system monitor (which sees every GPU of the machine) knows as CUDA's
    ordinal `index`: with CUDA_VISIBLE_DEVICES=2,3, cuda:0 is GPU 2."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index  # unset, or given as UUIDs: the ordinal is the best guess


def init_timeout_s(cfg: LoggerConfig) -> tuple[float, str]:
    """How long wandb.init may try to reach the server, and which setting said so."""
    env = os.environ.get("WANDB_INIT_TIMEOUT", "").strip()
    if env:
        try:
            if float(env) > 0:
                return float(env), "WANDB_INIT_TIMEOUT"
        except ValueError:
            pass
        raise UserError(
            f"WANDB_INIT_TIMEOUT={_shorten(env)} is not a number of seconds > 0: unset it or "
            "set logger.init_timeout_s"
        )
    return cfg.init_timeout_s, "logger.init_timeout_s"


def _wandb_reason(error: Exception, project: str) -> str:
    """W&B's own reason, first line only, with the project name shortened and the whole
    clipped (W&B quotes a 300-character name back in full)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    reason = lines[0].replace(project, _shorten(project, 40)) if project else lines[0]
    if len(reason) > _REASON_MAX_LEN:
        reason = reason[: _REASON_MAX_LEN - 3] + "..."
    return reason


def run_key(layout: Layout, rank: int) -> str:
    """The entry of ``wandb_ids.json`` for this rank's run: one per rank for ``group``."""
    return f"rank{rank}" if layout == Layout.group else layout.value


def fresh_run_id() -> str:
    """A new W&B run id: random, so an output dir deleted and re-created at the same path, or
    another machine's job of the same name, never reopens (and overwrites) an old run. The id
    is recorded in ``wandb_ids.json``: a resumed job reopens its runs from there."""
    return secrets.token_hex(8)


def _read_ids(path: Path) -> Dict[str, Dict[str, Any]]:
    """The runs recorded in ``wandb_ids.json`` ({} when absent or unreadable)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s (%s): new W&B runs will be started", path, e)
        return {}
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict):
        return {}
    return {k: v for k, v in runs.items() if isinstance(v, dict) and isinstance(v.get("id"), str)}


def _last_step(path: Path, run_id: str) -> int:
    """The highest ``step`` among the rows of W&B run ``run_id`` in a JSON-lines stats file (0
    when there is none): rows of an earlier run in the same dir (after trainer.resume=never)
    do not count."""
    best = 0
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                # Records start with "step" (see Tracker._append): no full parse of other runs'.
                found = _STEP_FIELD.match(line)
                if found and f'"run": "{run_id}"' in line:
                    best = max(best, int(found.group(1)))
    except OSError:
        pass
    return best


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

    def __init__(
        self,
        cfg: LoggerConfig,
        env: DistEnv,
        run: RunInfo,
        resumed_step: Optional[int] = None,
    ) -> None:
        """``resumed_step``: the step of the checkpoint this job resumed from (None: it
        started from step 0). Collective for ``logger.backend=wandb`` with the ``group`` and
        ``shared`` layouts (rank 0 hands every rank its run id): build it on every rank."""
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
        self._resumed_step = resumed_step
        self._run_id: Optional[str] = None  # this rank's W&B run: tags its rows in the files
        # Rows at or below these steps already went to the reopened W&B run: not sent again.
        self._sent_train = self._sent_eval = 0
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
            self._own = _append_to(self._stats_dir / f"rank{env.rank}.jsonl")
            if env.is_main:
                self._agg = _append_to(self._stats_dir / "aggregate.jsonl")
            if cfg.backend == LoggerBackend.wandb:
                # Decided on every rank (even one whose W&B is disabled): it may be collective.
                plan = self._plan_runs()
                # Shared: the primary (rank 0) first, then the others join its run, as W&B's
                # docs show; else every rank starts its own at once.
                turns = [env.is_main, not env.is_main] if cfg.layout == Layout.shared else [True]
                for mine in turns:
                    failure: Optional[str] = None
                    if mine and self._wandb_mode != "disabled":
                        try:
                            self._run = self._start_wandb(plan)
                        except UserError as e:
                            failure = str(e)
                    self._agree_on_start(failure)  # collective
                if self._run is not None:
                    self._run_id = self._run.id
        except BaseException:
            self.close(failed=True)
            raise

    # ---------------------------------------------------------------------------- W&B setup

    def _agree_on_start(self, failure: Optional[str]) -> None:
        """Collective: a rank whose W&B run could not start tells the others, so every rank
        stops with the same line instead of waiting dist.timeout_s for it (in the ``gather``
        layout only rank 0 starts one)."""
        env = self._env
        outcomes = all_gather_objects(failure, env) if env.distributed else [failure]
        failed = [(r, why) for r, why in enumerate(outcomes) if why is not None]
        if not failed:
            return
        rank, why = failed[0]
        if failure is not None:
            raise UserError(failure)
        raise UserError(f"rank {rank}: {why}")

    def _wandb_writes(self) -> bool:
        """Whether this rank owns a W&B run (all layouts but gather log from every rank)."""
        return self._env.is_main or self._layout != Layout.gather

    def _keys(self) -> List[str]:
        """The ``wandb_ids.json`` entries of this job's runs."""
        if self._layout == Layout.group:
            return [run_key(self._layout, r) for r in range(self._env.world_size)]
        return [run_key(self._layout, 0)]

    def _names(self, key: str) -> tuple[str, str]:
        """A new run's display name and group."""
        cfg, info = self._cfg, self._info
        name = cfg.name or info.job_name
        group = cfg.group or info.group
        if self._layout == Layout.group:
            # Ranks of different jobs in one sweep must not share a group.
            group = f"{group}-{info.job_name}"
            name = f"{name}-{key}"
        return _clip(name), _clip(group)

    def _plan_runs(self) -> Optional[Dict[str, Dict[str, Any]]]:
        """Which W&B run each of this job's runs is: ``{key: {id, name, group, resume, ...}}``.

        Rank 0 decides (reading and updating ``wandb_ids.json``); with ``group`` and
        ``shared`` it hands the plan to every rank in one broadcast, so all agree without
        reading a file another rank may be writing. Other ranks get None with ``gather``.
        """
        env = self._env
        collective = env.distributed and self._layout != Layout.gather
        plan: Optional[Dict[str, Dict[str, Any]]] = None
        if env.is_main:
            plan = self._decide_runs()
        if collective:
            box = [plan]
            dist.broadcast_object_list(box, src=0, device=env.device)
            plan = box[0]
        return plan

    def _decide_runs(self) -> Dict[str, Dict[str, Any]]:
        """Rank 0: reopen the recorded runs after a checkpoint resume, else start new ones."""
        cfg, info = self._cfg, self._info
        path = Path(info.output_dir) / IDS_FILE
        recorded = _read_ids(path)
        plan: Dict[str, Dict[str, Any]] = {}
        for key in self._keys():
            old = recorded.get(key)
            same_project = (
                old is not None
                and old.get("project") == cfg.project
                and old.get("entity") == cfg.entity
            )
            if self._resumed_step is not None and same_project:
                assert old is not None
                name, group = self._names(key)
                plan[key] = {
                    **old,
                    # An explicit logger.name / logger.group wins over the recorded one.
                    "name": name if cfg.name else old.get("name", name),
                    "group": group if cfg.group else old.get("group", group),
                    "resume": True,
                }
                continue
            attempt = 0
            if old is not None:
                previous = old.get("attempt", 0)
                attempt = previous + 1 if isinstance(previous, int) and previous >= 0 else 1
            name, group = self._names(key)
            plan[key] = {
                "id": fresh_run_id(),
                "project": cfg.project,
                "entity": cfg.entity,
                "name": name,
                "group": group,
                "attempt": attempt,
                "resume": False,
            }
        runs = {
            **recorded,
            **{k: {f: v for f, v in p.items() if f != "resume"} for k, p in plan.items()},
        }
        if runs != recorded:
            try:
                tmp = path.with_name(f".{IDS_FILE}.{os.getpid()}.tmp")
                tmp.write_text(
                    json.dumps({"runs": runs}, indent=2, sort_keys=True) + "\n", encoding="utf-8"
                )
                tmp.replace(path)
            except OSError as e:
                logger.warning(
                    "could not record the W&B run ids in %s (%s): a re-run will start new runs",
                    path,
                    e,
                )
        return plan

    def _sent_before(self, run_id: str) -> tuple[int, int]:
        """The newest train and eval steps the previous attempts may have sent to this
        rank's W&B run: the local stats files get every row (tagged with its run id) before
        W&B does."""
        stats, env = self._stats_dir, self._env
        if env.is_main:
            agg, ev = stats / "aggregate.jsonl", stats / "eval.jsonl"
            return _last_step(agg, run_id), _last_step(ev, run_id)
        return _last_step(stats / f"rank{env.rank}.jsonl", run_id), 0

    def _start_wandb(self, plan: Optional[Dict[str, Dict[str, Any]]]) -> Optional[Run]:
        if not self._wandb_writes():
            return None
        import wandb

        cfg, env, info = self._cfg, self._env, self._info
        assert plan is not None
        entry = plan[run_key(self._layout, env.rank)]
        settings, kwargs = self._wandb_settings(entry)
        out = Path(info.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = redact.config(info.config)
        # W&B records sys.argv as the run's command: the same, with secrets blanked.
        argv, sys.argv = sys.argv, [sys.argv[0], *redact.overrides(sys.argv[1:])]
        try:
            wb_run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=entry["name"],
                group=entry["group"],
                tags=[_clip(t, 64) for t in dict.fromkeys(cfg.tags)],
                config=config,
                dir=str(out),
                settings=wandb.Settings(**settings),
                **kwargs,
            )
        except (wandb.errors.AuthenticationError, wandb.errors.UsageError) as e:
            raise self._usage_error(e) from None
        except (wandb.errors.CommError, TimeoutError) as e:
            reason = _wandb_reason(e, cfg.project)
            if re.search(r"not found|404|403|permission|deleted|conflict|409", reason, re.I):
                # The server answered, and said no: nothing to do with the network.
                raise UserError(
                    f"W&B refused the run ({reason}): check logger.entity and logger.project "
                    "(and your access to them); a run deleted on the server cannot be resumed: "
                    f"remove {IDS_FILE} from the output dir to start new runs"
                ) from None
            # Else the server is out of reach (no network, a wrong WANDB_BASE_URL, a
            # firewall): wandb.init has given up after `timeout` seconds.
            timeout, timeout_from = init_timeout_s(cfg)
            raise UserError(
                f"W&B could not be reached within {timeout:g} s ({timeout_from}; "
                f"{_wandb_reason(e, cfg.project)}): rerun with logger.mode=offline and upload "
                "later with `wandb sync <output dir>/wandb/offline-run-*`, or check the "
                f"network and WANDB_BASE_URL, or raise {timeout_from}"
            ) from None
        except wandb.errors.Error as e:
            raise UserError(
                f"W&B could not start a run ({type(e).__name__}: "
                f"{_wandb_reason(e, cfg.project)}): set logger.mode=offline to train without "
                "the server, and upload later with `wandb sync`"
            ) from None
        finally:
            sys.argv = argv
        self._define_metrics(wb_run)
        if entry["resume"]:
            logger.info(
                "W&B run %s (%s) continued in %s: rows after step %d (checkpoint step %s)",
                wb_run.id,
                self._wandb_mode,
                out / "wandb",
                max(self._sent_train, self._sent_eval),
                self._resumed_step,
            )
        else:
            logger.info("W&B run %s (%s) in %s", wb_run.id, self._wandb_mode, out / "wandb")
        return wb_run

    def _wandb_settings(self, entry: Dict[str, Any]) -> tuple[Dict[str, Any], Dict[str, Any]]:
        """wandb.Settings and the other wandb.init arguments of this rank's run."""
        cfg, env = self._cfg, self._env
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
            # Bounded: the end of a job must not hang on a slow upload.
            "finish_timeout": cfg.finish_timeout_s,
        }
        if self._wandb_mode != "offline":
            settings["init_timeout"] = init_timeout_s(cfg)[0]
        # A fresh id is never reopened ("never": W&B refuses an id that exists instead of
        # mixing into it).
        kwargs: Dict[str, Any] = {"id": entry["id"], "resume": "never"}
        if entry["resume"]:
            # "allow", not "must": a run recorded offline and never synced does not exist on
            # the server yet, and an online re-run then starts it under the same id.
            kwargs["resume"] = "allow"
            self._sent_train, self._sent_eval = self._sent_before(entry["id"])
        if self._layout == Layout.group:
            kwargs["job_type"] = f"rank{env.rank}"
            settings["x_label"] = f"rank{env.rank}"
        elif self._layout == Layout.shared:
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
            settings["x_stats_gpu_device_ids"] = [physical_gpu(index)]
        return settings, kwargs

    def _usage_error(self, e: Exception) -> UserError:
        import wandb

        cfg = self._cfg
        reason = _wandb_reason(e, cfg.project)
        project = _shorten(cfg.project, quote=True)
        if isinstance(e, wandb.errors.AuthenticationError):
            todo = "log in again (`wandb login`, or WANDB_API_KEY), or set logger.mode=offline"
        elif self._wandb_mode == "offline":
            todo = (
                "fix logger.project / logger.entity / logger.name (W&B allows up to "
                f"{_WANDB_MAX_LEN} characters, none of / \\ # ? % :)"
            )
        else:
            todo = (
                "fix logger.project / logger.entity / logger.name and check your W&B "
                "login, or set logger.mode=offline"
            )
        return UserError(
            f"W&B could not start a run for logger.project={project} ({reason}): {todo}"
        )

    def _define_metrics(self, wb_run: Run) -> None:
        env = self._env
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
        if self._run is None or step <= self._sent_train:
            return  # a step the reopened W&B run already has
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

    def close_all(self) -> None:
        """Collective, at the end of a successful run: close on every rank; with the shared
        layout the other ranks first, so the primary finishes the run last."""
        shared = self._layout == Layout.shared and self._env.distributed
        if shared and not self._env.is_main:
            self.close()
        if self._env.distributed:
            dist.barrier()
        self.close()

    def add_config(self, values: Dict[str, Any]) -> None:
        """More of the run's config (e.g. its provenance), where this rank has a W&B run."""
        if self._run is not None:
            self._run.config.update(values, allow_val_change=True)

    def log_values(self, step: int, values: Dict[str, Any]) -> None:
        """Extra values of this rank at ``step`` (a callback's ``ctx.log``): numbers and text go
        to this rank's stats file and, like the rank's stats, to W&B (text as HTML); anything
        else (``wandb.Image``, ``wandb.Histogram``, ...) to W&B only. Not collective: ranks may
        log different keys at different steps. In the ``gather`` layout only rank 0 has a W&B
        run."""
        if self._closed:
            return
        numbers = {
            k: float(v) if not isinstance(v, (int, str)) else v
            for k, v in values.items()
            if isinstance(v, (int, float, str)) or (torch.is_tensor(v) and v.numel() == 1)
        }
        if numbers:
            self._append(
                self._own, {"step": step, "time": time.time(), "rank": self._env.rank, **numbers}
            )
        if self._run is None or step <= self._sent_train:
            return
        prefix = "train" if self._layout == Layout.group else f"rank{self._env.rank}"
        row = {f"{prefix}/{k}": _for_wandb(numbers.get(k, v)) for k, v in values.items()}
        self._run.log({STEP_METRIC: step, **row})

    def log_eval(self, step: int, metrics: Dict[str, float]) -> None:
        """Record evaluation metrics keyed like ``val/acc`` or ``test/loss`` (rank 0 only)."""
        if not self._env.is_main or self._closed:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        if self._eval is None:
            self._eval = _append_to(self._stats_dir / "eval.jsonl")
        self._append(self._eval, {"step": step, "time": time.time(), **metrics})
        if self._run is not None and step > self._sent_eval:
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
        merged.update({k: jsonfile.finite_or_none(float(v)) for k, v in metrics.items()})
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
        if self._run is not None:
            self._run.summary.update(dict(metrics))

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        """Complete the last interval, finish the W&B run and close the files. Idempotent.
        `failed`: the run finishes with exit code 1; `preempted` (the signal's number): marked
        preempted, exit code 128 + signal, as the process. Not collective, but on success every
        rank must call it (the last interval's gather is waited for)."""
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
                if preempted:
                    run.mark_preempting()
                run.finish(exit_code=128 + preempted if preempted else int(failed))
            except Exception:  # closing must not mask the error that made us close
                logger.exception("could not finish W&B run %s", run.id)
            if self._wandb_mode == "offline" and self._env.is_main:
                logger.info(
                    "W&B offline run saved; upload it later with `wandb sync %s`",
                    shlex.quote(str(Path(run.dir).parent)),
                )
        for attr in ("_own", "_agg", "_eval"):
            handle = getattr(self, attr)
            setattr(self, attr, None)
            if handle is not None:
                handle.close()
        if error is not None:
            raise error

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leaving a `with tracker:` block on an error closes it as failed."""
        if exc is not None:
            self.close(failed=True)

    def _append(self, handle: Optional[TextIO], record: Dict[str, Any]) -> None:
        if handle is None:
            return
        if self._run_id is not None:
            record["run"] = self._run_id
        clean = {k: jsonfile.finite_or_none(v) for k, v in record.items()}
        handle.write(json.dumps(clean, allow_nan=False) + "\n")
        handle.flush()  # a crashed or killed rank still leaves its stats up to the last interval


def make_tracker(
    cfg: LoggerConfig, env: DistEnv, run: RunInfo, resumed_step: Optional[int] = None
) -> Tracker:
    """Build the tracker for one job (``logger.backend=none`` keeps W&B out entirely).

    ``resumed_step``: the step of the checkpoint the job resumed from, or None when it started
    from step 0; a resumed job continues the W&B runs recorded in its output dir."""
    return Tracker(cfg, env, run, resumed_step=resumed_step)
