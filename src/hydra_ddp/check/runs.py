"""The checker's runs: the user's training command as a subprocess, with the check's overrides
after the user's (the last value of a key wins) and the probe added, and what each run recorded
read back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hydra_ddp.config import TrainConfig

PROBE = "hydra_ddp_check"  # the probe's name under `callbacks`


@dataclass
class CheckPlan:
    """What the check runs: the user's config (typed) and command line, on `world` ranks,
    for `steps` steps, everything under `root`."""

    cfg: TrainConfig
    overrides: list[str]  # the user's, without hydra.run.dir
    config_args: list[str]  # --config-path/--config-name as given
    world: int
    steps: int
    root: Path
    # A last resort: a rank that waits for another fails by itself after dist.timeout_s.
    timeout_s: float = 3600.0

    @property
    def stop_step(self) -> int:
        return self.steps // 2


@dataclass
class Run:
    """One finished run: its dir, the probe's records, and how it ended."""

    name: str
    dir: Path
    rec: Path
    code: int
    error: str | None
    records: dict[int, dict[int, dict]] = field(default_factory=dict)  # rank -> step -> record

    @property
    def log(self) -> Path:
        return self.dir.parent / f"{self.name}.log"

    def load(self, name: str) -> Any:
        """A tensor file the probe wrote, or None."""
        path = self.rec / name
        return torch.load(path, weights_only=False) if path.is_file() else None

    def failed(self) -> str | None:
        """Why the run did not finish (None: it did)."""
        if self.code == 0:
            return None
        return f"{self.error or f'exit status {self.code}'} (log: {self.log})"


def quoted(value: Any) -> str:
    """A value as Hydra's override grammar reads it literally."""
    text = str(value)
    return f"'{text}'" if re.search(r"[=,:'\"()\[\]{}\s\\$]", text) else text


def train_run(
    plan: CheckPlan,
    name: str,
    *extra: str,
    world: int | None = None,
    run_dir: str | None = None,
    **probe: Any,
) -> Run:
    """Run the user's training as `name` (in `run_dir`, default `name`) with `extra` overrides
    and the probe's arguments (stop_at, grads_at, predict), to its end."""
    rec, run_dir = plan.root / f"{name}.rec", plan.root / (run_dir or name)
    args = [
        *plan.overrides,
        f"dist.nproc_per_node={world or plan.world}",
        f"hydra.run.dir={quoted(run_dir)}",
        f"trainer.max_steps={plan.steps}",
        "trainer.resume=auto",  # each run its own: fresh, or the stopped run's checkpoint
        "logger=none",
        "trainer.progress=false",
        f"+callbacks.{PROBE}._target_=hydra_ddp.check.probe.Probe",
        f"+callbacks.{PROBE}.out={quoted(rec)}",
        *(f"+callbacks.{PROBE}.{k}={v}" for k, v in probe.items()),
        *extra,
    ]
    if probe.get("predict"):
        args += [
            f"+callbacks.{PROBE}.sampler=${{sampler}}",
            f"+callbacks.{PROBE}.batch_size=${{trainer.batch_size}}",
            f"+callbacks.{PROBE}.precision=${{trainer.precision}}",
        ]
    return _finished(name, run_dir, rec, *_run(plan, "hydra_ddp.train", args, name))


def eval_run(plan: CheckPlan, run: Run) -> Run:
    """`python -m hydra_ddp.eval run=<dir> predict=true split=val` in a fresh process (one
    rank): the last checkpoint's validation outputs."""
    args = [f"run={run.dir}", "predict=true", "split=val", "dist.nproc_per_node=1"]
    return _finished("eval", run.dir, run.dir, *_run(plan, "hydra_ddp.eval", args, "eval"))


def _run(plan: CheckPlan, module: str, args: list[str], name: str) -> tuple[int, str | None]:
    """The command's exit status and its error line; its output goes to <root>/<name>.log."""
    own = plan.config_args if module == "hydra_ddp.train" else []
    command = [sys.executable, "-m", module, *own, *args]
    log = plan.root / f"{name}.log"
    sys.stderr.write(f"running {name}: {log}\n")
    with open(log, "w") as out:
        out.write(" ".join(command) + "\n")
        out.flush()
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=plan.timeout_s)
        except BaseException as e:  # the time is up, or Ctrl-C: the run's ranks go too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            return -9, f"did not finish in {plan.timeout_s:g} s (a rank waiting for another?)"
    return code, _error_line(log.read_text(errors="replace")) if code else None


def _error_line(output: str) -> str | None:
    """The run's own one-line error (`error: ...`), else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for line in lines:
        if "error: " in line:
            return line[line.index("error: ") :]
    return lines[-1] if lines else None


def _finished(name: str, run_dir: Path, rec: Path, code: int, error: str | None) -> Run:
    run = Run(name, run_dir, rec, code, error)
    for path in sorted(rec.glob("rank*.jsonl")):
        rank = int(path.stem[len("rank") :])
        lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        run.records[rank] = {r["step"]: r for r in lines}
    return run


def stopped_at(run: Run) -> int | None:
    """The step a run stopped at on SIGTERM with a checkpoint (its last record), else None."""
    if run.code != 128 + signal.SIGTERM:
        return None
    return max(run.records.get(0, {}), default=0) or None
