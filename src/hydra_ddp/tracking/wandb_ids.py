"""One job, one set of W&B runs across restarts (docs/wandb_resume.md).

The run ids (one per layout, or one per rank for ``group``) are recorded, with the runs' names
and groups, in ``<output_dir>/wandb_ids.json`` by rank 0. A job that resumed from a checkpoint
in that dir reopens the recorded runs and sends W&B only the rows after the newest step it
already sent (read back from the local stats files, which always get a row before W&B does, each
row tagged with its run id), so no step is logged twice or rewound. A job that starts from step
0 in a dir that has recorded runs gets new, random ids.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from hydra_ddp.config import Layout, LoggerConfig
from hydra_ddp.disk import open_regular, read_regular
from hydra_ddp.distributed import DistEnv
from hydra_ddp.tracking.files import STEP_FIELD, SUPERSEDED
from hydra_ddp.tracking.sink import RunInfo
from hydra_ddp.tracking.wandb_errors import IDS_FILE, clip

logger = logging.getLogger(__name__)

_FIX = "remove it, or move it away (the job keeps a regular file there)"
Plan = Dict[str, Dict[str, Any]]  # {key: {id, project, entity, name, group, attempt, resume}}


def run_key(layout: Layout, rank: int) -> str:
    """The entry of ``wandb_ids.json`` for this rank's run: one per rank for ``group``."""
    return f"rank{rank}" if layout == Layout.group else layout.value


def fresh_run_id() -> str:
    """A new W&B run id: random, so an output dir deleted and re-created at the same path, or
    another machine's job of the same name, never reopens (and overwrites) an old run."""
    return secrets.token_hex(8)


def read_ids(path: Path) -> Dict[str, Dict[str, Any]]:
    """The runs recorded in ``wandb_ids.json`` ({} when absent or unreadable)."""
    try:
        data = json.loads(read_regular(path, what="W&B run record", fix=_FIX))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s (%s): new W&B runs will be started", path, e)
        return {}
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict):
        return {}
    return {k: v for k, v in runs.items() if isinstance(v, dict) and isinstance(v.get("id"), str)}


def last_step(path: Path, run_id: str) -> int:
    """The highest step among the rows of W&B run `run_id` in a stats file and in its
    superseded rows (0 when there is none): rows of another run do not count."""
    best = 0
    for candidate in (path, path.parent / SUPERSEDED / path.name):
        try:
            with open_regular(candidate, what="stats file", fix=_FIX, encoding="utf-8") as handle:
                for line in handle:
                    found = STEP_FIELD.match(line)
                    if found and f'"run": "{run_id}"' in line:
                        best = max(best, int(found.group(1)))
        except OSError:
            pass
    return best


def sent_before(stats: Path, env: DistEnv, run_id: str) -> tuple[int, int]:
    """The newest train and eval steps earlier attempts may have sent to this rank's run."""
    if env.is_main:
        return last_step(stats / "aggregate.jsonl", run_id), last_step(stats / "eval.jsonl", run_id)
    return last_step(stats / f"rank{env.rank}.jsonl", run_id), 0


def plan_runs(
    cfg: LoggerConfig, env: DistEnv, info: RunInfo, resumed_step: Optional[int]
) -> Optional[Plan]:
    """Which W&B run each of this job's runs is. Rank 0 decides (reading and updating
    ``wandb_ids.json``); with ``group`` and ``shared`` it hands the plan to every rank in one
    broadcast, so all agree without reading a file another rank may be writing. Other ranks
    get None with ``gather``. `# collective` for group and shared."""
    plan = _decide(cfg, env, info, resumed_step) if env.is_main else None
    if env.distributed and cfg.layout != Layout.gather:
        box = [plan]
        dist.broadcast_object_list(box, src=0, device=env.device)
        plan = box[0]
    return plan


def _keys(layout: Layout, world_size: int) -> List[str]:
    if layout == Layout.group:
        return [run_key(layout, r) for r in range(world_size)]
    return [run_key(layout, 0)]


def _names(cfg: LoggerConfig, info: RunInfo, key: str) -> tuple[str, str]:
    """A new run's display name and group."""
    name = cfg.name or info.job_name
    group = cfg.group or info.group
    if cfg.layout == Layout.group:
        # Ranks of different jobs in one sweep must not share a group.
        group = f"{group}-{info.job_name}"
        name = f"{name}-{key}"
    return clip(name), clip(group)


def _decide(cfg: LoggerConfig, env: DistEnv, info: RunInfo, resumed_step: Optional[int]) -> Plan:
    """Rank 0: reopen the recorded runs after a checkpoint resume, else start new ones."""
    path = Path(info.output_dir) / IDS_FILE
    recorded = read_ids(path)
    plan: Plan = {}
    for key in _keys(cfg.layout, env.world_size):
        old = recorded.get(key)
        name, group = _names(cfg, info, key)
        same_project = (
            old is not None
            and old.get("project") == cfg.project
            and old.get("entity") == cfg.entity
        )
        if resumed_step is not None and same_project:
            assert old is not None
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
        _record(path, runs)
    return plan


def _record(path: Path, runs: Dict[str, Any]) -> None:
    try:
        tmp = path.with_name(f".{IDS_FILE}.{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps({"runs": runs}, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        tmp.replace(path)
    except OSError as e:
        logger.warning(
            "could not record the W&B run ids in %s (%s): a re-run will start new runs", path, e
        )
