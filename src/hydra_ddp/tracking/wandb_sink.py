"""The W&B sink (``logger=wandb``) in the ``logger.layout`` W&B documents for distributed
training, and how a job started again in its dir reopens its runs: docs/tracking.md and
docs/wandb_resume.md. How its run starts and fails: wandb_mode.py.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch.distributed as dist

from hydra_ddp import redact
from hydra_ddp.config import Layout, LoggerConfig
from hydra_ddp.disk import open_regular
from hydra_ddp.distributed import DistEnv, all_gather_objects
from hydra_ddp.errors import UserError
from hydra_ddp.rundir import jsonfile
from hydra_ddp.tracking import names
from hydra_ddp.tracking.files import STEP_FIELD, SUPERSEDED
from hydra_ddp.tracking.sink import Kind, Record, RunInfo, Sink
from hydra_ddp.tracking.wandb_mode import clip, init_error, init_timeout_s, resolve_mode

if TYPE_CHECKING:
    from wandb import Run

logger = logging.getLogger(__name__)

_RUN_FIELD = re.compile(r'"run": "([^"]+)"')
# Where earlier versions recorded a job's run ids (read for a dir whose stats rows name none).
LEGACY_IDS_FILE = "wandb_ids.json"
_FIX = "remove it, or move it away (the job keeps a regular file there)"


def physical_gpu(index: int) -> int:
    """The GPU id W&B's system monitor (which sees every GPU of the machine) knows as CUDA's
    ordinal `index`: with CUDA_VISIBLE_DEVICES=2,3, cuda:0 is GPU 2."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index  # unset, or given as UUIDs: the ordinal is the best guess


def _for_wandb(value: Any) -> Any:
    """Text as preformatted HTML (a plain string is no W&B chart); the rest as it is."""
    if isinstance(value, str):
        import html

        import wandb

        return wandb.Html(f"<pre>{html.escape(value)}</pre>")
    return value


class WandbSink(Sink):
    @staticmethod
    def check_before_launch(logger_cfg: LoggerConfig) -> None:
        resolve_mode(logger_cfg.mode)  # logger.mode=online without a login: one line, once

    def __init__(
        self,
        logger_cfg: LoggerConfig,
        env: DistEnv,
        run: RunInfo,
        resumed_step: Optional[int],
        stats_dir: Path,
    ) -> None:
        """`# collective`: build it on every rank. Its options are the typed logger.* keys."""
        cfg, info, stats = logger_cfg, run, stats_dir
        self.cfg, self.env, self.layout = cfg, env, cfg.layout
        self.run: Optional[Run] = None
        self.last_sent = -math.inf  # time.monotonic() of the last training row sent
        self.unsent: Optional[Dict[str, Any]] = None  # a throttled row, sent at close
        self.mode, why = resolve_mode(cfg.mode)
        # Checked on every rank before any collective, so all ranks fail alike and fast.
        if cfg.layout == Layout.shared and self.mode == "offline":
            raise UserError(
                f"logger.layout=shared needs W&B online ({why}); use logger.layout=gather or "
                "group, or log in (`wandb login` or WANDB_API_KEY)"
            )
        logger.info("W&B mode %s (%s), layout %s", self.mode, why, cfg.layout.value)
        try:
            # Found on every rank (even one whose W&B is disabled): it may be collective.
            self.id, self.sent_train, self.sent_eval = self._find_run(info, stats)
            # Shared: the primary (rank 0) first, then the others join its run, as W&B's docs
            # show; else every rank starts its own at once.
            turns = [env.is_main, not env.is_main] if self.layout == Layout.shared else [True]
            for mine in turns:
                failure: Optional[str] = None
                if (
                    mine
                    and self.mode != "disabled"
                    and (env.is_main or self.layout != Layout.gather)
                ):
                    try:
                        self.run = self._start(info, resumed_step)
                    except UserError as e:
                        failure = str(e)
                self._agree_on_start(failure)  # collective
        except BaseException:
            self.close(failed=True)
            raise

    @property
    def run_id(self) -> Optional[str]:
        return None if self.run is None else self.run.id

    @property
    def gathers_values(self) -> bool:
        # Rank 0 writes the other ranks' ctx.log values: they have no run.
        return self.layout == Layout.gather

    def _agree_on_start(self, failure: Optional[str]) -> None:
        """`# collective`: a rank whose W&B run could not start tells the others, so every rank
        stops with the same line instead of waiting dist.timeout_s for it."""
        outcomes = all_gather_objects(failure, self.env) if self.env.distributed else [failure]
        if failure is not None:
            raise UserError(failure)
        for rank, why in enumerate(outcomes):
            if why is not None:
                raise UserError(f"rank {rank}: {why}")

    def _find_run(self, info: RunInfo, stats: Path) -> tuple[str, int, int]:
        """This rank's W&B run id, and the newest train and eval steps already sent to it, from
        rank 0's aggregate and eval rows or another rank's own rows (its files may be on its own
        node); under `shared` every rank takes rank 0's run. `# collective` for shared."""
        env = self.env
        own = stats / ("aggregate.jsonl" if env.is_main else f"rank{env.rank}.jsonl")
        newest, train = _sent(own)
        _, evals = _sent(stats / "eval.jsonl") if env.is_main else (None, {})
        key = f"rank{env.rank}" if self.layout == Layout.group else self.layout.value
        run_id = newest or _legacy_id(Path(info.output_dir), key, self.cfg) or secrets.token_hex(8)
        if self.layout == Layout.shared and env.distributed:
            box = [run_id]
            dist.broadcast_object_list(box, src=0, device=env.device)  # collective
            run_id = box[0]
        return run_id, train.get(run_id, 0), evals.get(run_id, 0)

    def _start(self, info: RunInfo, resumed: Optional[int]) -> Run:
        import wandb

        cfg, env = self.cfg, self.env
        settings = _settings(cfg, env, self.mode)
        name, group = cfg.name or info.job_name, cfg.group or info.group
        if self.layout == Layout.group:
            name = f"{name}-rank{env.rank}"
        config = redact.config(info.config)
        if info.swept:  # a sweep's job: W&B groups the sweep's runs by these keys
            config["swept"] = info.swept
        out = Path(info.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        # W&B records sys.argv as the run's command: the same, with secrets blanked.
        argv, sys.argv = sys.argv, [sys.argv[0], *redact.overrides(sys.argv[1:])]
        try:
            run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=clip(name), group=clip(group),
                tags=[clip(t, 64) for t in dict.fromkeys(cfg.tags)], config=config,
                dir=str(out), id=self.id, resume="allow", settings=wandb.Settings(**settings),
                job_type=f"rank{env.rank}" if self.layout == Layout.group else None,
            )  # fmt: skip
        except (wandb.errors.Error, TimeoutError) as e:
            raise init_error(e, cfg, self.mode) from None
        finally:
            sys.argv = argv
        _define_metrics(run, self.layout, env)
        sent = max(self.sent_train, self.sent_eval)
        logger.info(
            "W&B run %s (%s) in %s%s", run.id, self.mode, out / "wandb",
            f", continued: rows after step {sent} (resumed at step {resumed})" if sent else "",
        )  # fmt: skip
        return run

    def _prefix(self, rank: int) -> str:
        return "train" if self.layout == Layout.group else f"rank{rank}"

    def log(self, record: Record, step: int) -> None:
        if self.run is None:
            return
        if record.kind == Kind.interval and step > self.sent_train:
            self._log_interval(record, step)
        elif record.kind == Kind.values and step > self.sent_train:
            prefix = self._prefix(record.rank)
            row = {f"{prefix}/{k}": _for_wandb(v) for k, v in record.values.items()}
            self.run.log({names.STEP_METRIC: step, **row})
        elif record.kind == Kind.eval and step > self.sent_eval:
            self.run.log({names.STEP_METRIC: step, **record.values})

    def _log_interval(self, record: Record, step: int) -> None:
        row: Dict[str, Any] = {names.STEP_METRIC: step}
        for r in record.table if self.layout == Layout.gather else [record.rank]:
            row.update({f"{self._prefix(r)}/{k}": v for k, v in record.table[r].items()})
        row.update({f"agg/{k}": v for k, v in record.aggregates.items()})
        now = time.monotonic()
        if now - self.last_sent >= self.cfg.min_interval_s:
            self.run.log(row)
            self.last_sent, self.unsent = now, None
        else:
            self.unsent = row  # sent at close if no later row replaces it

    def summary(self, values: Dict[str, float]) -> None:
        if self.run is not None:
            self.run.summary.update(dict(values))

    def add_config(self, values: Dict[str, Any]) -> None:
        if self.run is not None:
            self.run.config.update(values, allow_val_change=True)

    def close(self, failed: bool = False, preempted: int = 0) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            if self.unsent is not None:
                run.log(self.unsent)
            if preempted:
                run.mark_preempting()
            run.finish(exit_code=128 + preempted if preempted else int(failed))
        except Exception:  # closing must not mask the error that made us close
            logger.exception("could not finish W&B run %s", run.id)
        if self.mode == "offline" and self.env.is_main:
            logger.info(
                "W&B offline run saved; upload it later with `wandb sync %s`",
                shlex.quote(str(Path(run.dir).parent)),
            )


def _settings(cfg: LoggerConfig, env: DistEnv, mode: str) -> Dict[str, Any]:
    """The wandb.Settings of this rank's run."""
    settings: Dict[str, Any] = {
        "mode": mode,
        # Hydra's basic launcher runs a sweep's jobs one after another in one process: each
        # job must get a fresh run even if a previous job never closed its tracker.
        "reinit": "finish_previous",
        # One rank talking is enough; the others' runs still record everything.
        "silent": not env.is_main,
        # No sparkline wall of every key at the end: the job prints its own summary.
        "quiet": True,
        "console": cfg.console.value,
        # Bounded: the end of a job must not hang on a slow upload.
        "finish_timeout": cfg.finish_timeout_s,
    }
    if mode != "offline":
        settings["init_timeout"] = init_timeout_s(cfg)[0]
    if cfg.layout == Layout.group:
        settings["x_label"] = f"rank{env.rank}"
    elif cfg.layout == Layout.shared:
        settings.update(
            mode="shared",
            x_label=f"rank{env.rank}",
            x_primary=env.is_main,
            # Only the primary decides whether the run finished or failed.
            x_update_finish_state=env.is_main,
        )
    if cfg.layout != Layout.gather and env.device.type == "cuda":
        # System stats of this rank's own GPU only; gather's single run watches them all.
        index = env.device.index if env.device.index is not None else env.local_rank
        settings["x_stats_gpu_device_ids"] = [physical_gpu(index)]
    return settings


def _define_metrics(run: Run, layout: Layout, env: DistEnv) -> None:
    run.define_metric(names.STEP_METRIC)
    if layout == Layout.group:
        families = ["train/*"]
    else:
        # W&B globs only match a trailing '*', hence one pattern per rank.
        ranks = range(env.world_size) if env.is_main else [env.rank]
        families = [f"rank{r}/*" for r in ranks]
    if env.is_main:
        families += ["agg/*", "val/*", "test/*"]
    for pattern in families:
        run.define_metric(pattern, step_metric=names.STEP_METRIC)


def _sent(path: Path) -> tuple[Optional[str], Dict[str, int]]:
    """The run the newest row of a stats file (or its superseded rows) went to, and each run's
    highest step there."""
    newest: Optional[str] = None
    steps: Dict[str, int] = {}
    for candidate in (path.parent / SUPERSEDED / path.name, path):
        try:
            with open_regular(candidate, what="stats file", fix=_FIX, encoding="utf-8") as f:
                for line in f:
                    step, run = STEP_FIELD.match(line), _RUN_FIELD.search(line)
                    if step and run:
                        newest = run.group(1)
                        steps[newest] = max(steps.get(newest, 0), int(step.group(1)))
        except OSError:
            pass
    return newest, steps


def _legacy_id(output_dir: Path, key: str, cfg: LoggerConfig) -> Optional[str]:
    """The run id an earlier version recorded in wandb_ids.json (it did not tag the rows)."""
    try:
        entry = jsonfile.read(output_dir / LEGACY_IDS_FILE)["runs"][key]
        same = entry["project"] == cfg.project and entry["entity"] == cfg.entity
    except (LookupError, TypeError):  # no record (None), or not one of runs
        return None
    return entry["id"] if same and isinstance(entry.get("id"), str) else None
