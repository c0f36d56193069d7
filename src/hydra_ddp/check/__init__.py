"""`python -m hydra_ddp.check <the overrides you train with>`: are distributed training and
resume right for *your* model, data, sampler policy, callbacks and step? Short real jobs of the
training command with a probe (probe.py), one table row per check (checks.py), `check.json`;
exit 0 only if every check that ran passed. docs/check.md says what each check catches.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hydra_ddp import checkpoint
from hydra_ddp.check import checks, runs
from hydra_ddp.check.checks import Result
from hydra_ddp.check.runs import CheckPlan, Run
from hydra_ddp.components import build
from hydra_ddp.data import check_sampling, epoch_rows
from hydra_ddp.data.policies import train_file_rows
from hydra_ddp.errors import UserError, first_line
from hydra_ddp.launch.command import compose_typed
from hydra_ddp.launcher_env import under_launcher

# The checks in the table's order: the name --only and --skip take -> the row's title.
CHECKS = {
    "rank_agreement": "rank agreement", "resume": "resume equivalence", "rows": "rows",
    "determinism": "determinism", "gradient_sync": "gradient sync",
    "checkpoint": "checkpoint round trip",
}  # fmt: skip
_TEMPORARY = "hydra-ddp-check-"


def main(config_path: str | Path | None = None, config_name: str = "train") -> None:
    """`python -m hydra_ddp.check`, `hydra-ddp-check` and a thin project's `api.run_checks`
    (--config-path and --config-name on the command line win). Exits 0, 1 (a check failed) or 2
    (bad input)."""
    args = _parser().parse_intermixed_args()
    try:
        wanted = _wanted(args.only, args.skip)
        plan = _plan(args, args.config_path or config_path, args.config_name or config_name)
    except Exception as e:
        sys.stderr.write(f"error: {first_line(e, 400)}\n")
        sys.exit(2)
    started = time.monotonic()
    try:
        results = run_wanted(plan, wanted)
    except UserError as e:  # the data or a component cannot be built: as training says it
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stderr.write(f"stopped on SIGINT: the runs so far are in {plan.root}\n")
        sys.exit(130)
    seconds = time.monotonic() - started
    failed = any(r.status == "FAIL" for r in results.values())
    report = plan.root / "check.json"
    report.write_text(json.dumps({
        "passed": not failed, "seconds": round(seconds, 1), "world_size": plan.world,
        "steps": plan.steps, "checks": {name: asdict(r) for name, r in results.items()},
    }, indent=2))  # fmt: skip
    print(result_table(results))
    if not failed and plan.root.name.startswith(_TEMPORARY):  # runs worth keeping only to look
        for path in plan.root.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
            elif path != report:
                path.unlink()
    print(f"{seconds:.0f} s, {plan.world} rank(s), {plan.steps} steps: {report}")
    sys.exit(1 if failed else 0)


def run_wanted(plan: CheckPlan, wanted: list[str]) -> dict[str, Result]:
    """Run what the `wanted` checks need, then judge each: one run straight through first (A),
    which every check but rows reads."""
    done: dict[str, Result] = {}
    if "rows" in wanted:
        done["rows"] = checks.row_coverage(plan, None)
    if set(wanted) - {"rows"}:
        if "rows" in done and "batches per rank" in done["rows"].measured:  # it would hang
            return {n: done.get(n) or checks.skip("the ranks take different steps (rows)")
                    for n in wanted}  # fmt: skip
        a = runs.train_run(plan, "straight", grads_at=int("gradient_sync" in wanted),
                       predict="checkpoint" in wanted)  # fmt: skip
        if "rows" in wanted:
            done["rows"] = checks.row_coverage(plan, a)
        if "rank_agreement" in wanted:
            done["rank_agreement"] = checks.rank_agreement(plan, a)
        if "gradient_sync" in wanted:
            done["gradient_sync"] = checks.gradient_sync(plan, a)
        if "checkpoint" in wanted:
            e = None if a.failed() else runs.eval_run(plan, a)
            done["checkpoint"] = checks.checkpoint_round_trip(plan, a, e)
        if {"resume", "determinism"} & set(wanted):
            _stop_and_resume(plan, wanted, a, done)
    return {name: done[name] for name in CHECKS if name in done}


def _stop_and_resume(plan: CheckPlan, wanted: list[str], a: Run, done: dict[str, Result]) -> None:
    """B: the run again, stopped after half its steps as SIGTERM would (also the second run
    with the same seed that determinism compares); C: B resumed to the end in its dir; and B
    resumed on another rank count."""
    if a.failed():
        for name in {"resume", "determinism"} & set(wanted):
            done[name] = checks.broken(a)
        return
    b = runs.train_run(plan, "stopped", stop_at=plan.stop_step)
    if "determinism" in wanted:
        strict = None
        if checks.first_difference(a, b, plan.stop_step):  # can torch name the op?
            strict = runs.train_run(plan, "deterministic", "trainer.deterministic=true",
                                f"trainer.max_steps={plan.stop_step}")  # fmt: skip
        done["determinism"] = checks.determinism(plan, a, b, strict)
    if "resume" in wanted:
        stopped = runs.stopped_at(b) is not None
        other = _other_world(plan, b) if stopped else ""
        c = runs.train_run(plan, "resumed", run_dir="stopped") if stopped else None
        done["resume"] = checks.resume_equivalence(plan, a, b, c, other)


def _other_world(plan: CheckPlan, b: Run) -> Run | str:
    """B resumed on 1 rank (2 if the job has 1) with the same global batch where the sampler
    policy then continues the epoch exactly; else why not, with the rows it would read twice
    or skip as the sampler counts them."""
    cfg = plan.cfg
    world, rows = (1 if plan.world > 1 else 2), cfg.trainer.batch_size * plan.world
    if rows % world or checks.on_gpu(plan) and world > torch.cuda.device_count():
        return f"{world} rank(s) cannot take a global batch of {rows} rows here"
    source, settings = build(cfg.data, "data"), epoch_rows.settings(cfg.sampler, cfg.sampler_seed)
    try:
        check_sampling(source, cfg.sampler, world, rows // world)
    except Exception as e:  # a data set too small for that many ranks
        return f"not on {world} rank(s): {e}"
    if not epoch_rows.reading_order_changed(settings, settings, plan.world, world):
        resume_from = runs.quoted(checkpoint.latest(b.dir))
        return runs.train_run(plan, "other_world", f"trainer.batch_size={rows // world}",
                          f"trainer.resume={resume_from}", world=world)  # fmt: skip
    n, files = source.num_rows("train"), train_file_rows(source)
    old = epoch_rows.Setup(settings, plan.world, cfg.trainer.batch_size)
    new = epoch_rows.Setup(settings, world, rows // world)
    epoch, done = divmod(plan.stop_step * cfg.trainer.grad_accum,
                         epoch_rows.batches_per_epoch(old, n, files, 0))  # fmt: skip
    twice, skipped = epoch_rows.twice_and_skipped(old, new, n, files, epoch, done, done)
    return f"{world} rank(s) read another order: {twice} rows twice, {skipped} skipped"


def result_table(results: dict[str, Result]) -> str:
    """One row per check; under a FAIL or SKIP, what is wrong (or why not) and where to look."""
    width = max(len(CHECKS[name]) for name in results) if results else 5
    lines = [f"{'check':<{width}}  result  measured"]
    for name, r in results.items():
        lines.append(f"{CHECKS[name]:<{width}}  {r.status:<6}  {r.measured}")
        lines += [f"{'':<{width}}  -> {r.why}"] if r.why else []
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hydra_ddp.check",
        description="Short real runs of your training command, checked: " + ", ".join(CHECKS),
    )
    parser.add_argument("overrides", nargs="*", help="the overrides you train with (key=value)")
    parser.add_argument("--only", help="comma-separated checks to run (default: all)")
    parser.add_argument("--skip", help="comma-separated checks to leave out")
    parser.add_argument("--steps", type=int, default=16, help="steps per run (default 16)")
    parser.add_argument("--config-path", "-cp", help="the config dir (a thin project's conf/)")
    parser.add_argument("--config-name", "-cn", help="its primary config (default: train)")
    return parser


def _wanted(only: str | None, skip: str | None) -> list[str]:
    lists = [[n.strip() for n in (text or "").split(",") if n.strip()] for text in (only, skip)]
    for flag, names in zip(("--only", "--skip"), lists):
        if set(names) - set(CHECKS):
            wrong = sorted(set(names) - set(CHECKS))[0]
            raise UserError(f"{flag} {wrong}: no such check; the checks: {', '.join(CHECKS)}")
    wanted = [n for n in CHECKS if (not only or n in lists[0]) and n not in lists[1]]
    if not wanted:  # an empty table and exit 0 would read as a pass
        raise UserError(f"--only {only} --skip {skip} leaves no check to run")
    return wanted


def _plan(args: argparse.Namespace, config_path: str | Path | None, config_name: str) -> CheckPlan:
    """The user's config, composed, typed and checked as training would, and where the runs go:
    hydra.run.dir if given (new or empty), else a temporary dir."""
    if under_launcher():
        raise UserError("the check starts its own ranks: run it as a plain command")
    if args.steps < 2:
        raise UserError(f"--steps {args.steps}: at least 2 (the resume check stops at half)")
    given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("hydra.run.dir=")]
    kept = [o for o in args.overrides if not o.startswith("hydra.run.dir=")]
    cfg = compose_typed(config_path, config_name, [o for o in kept if not o.startswith("hydra.")])
    root = Path(given[-1].strip("'\"")).expanduser().resolve() if given else None
    if root is not None and root.exists() and any(root.iterdir()):
        raise UserError(f"hydra.run.dir={root} is not empty: give a new dir for the check's runs")
    if root is None:
        root = Path(tempfile.mkdtemp(prefix=_TEMPORARY))
    root.mkdir(parents=True, exist_ok=True)
    nproc_given = any(o.startswith("dist.nproc_per_node=") for o in kept)
    world = cfg.dist.nproc_per_node if nproc_given or cfg.dist.nproc_per_node > 1 else 2
    where = [f"--config-path={Path(config_path).resolve()}"] if config_path is not None else []
    where += [f"--config-name={config_name}"] if where or config_name != "train" else []
    return CheckPlan(cfg, kept, where, world, args.steps, root)
