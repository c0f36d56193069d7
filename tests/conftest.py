"""Shared helpers: run the commands a user types, in a subprocess, in a scratch directory.

Every run happens in `tmp_path` (Hydra's outputs/ and multirun/ land there), with W&B isolated
under it and forced offline, and with a timeout so a hang fails the test instead of CI.

Real launches are few and each checks many things (see the module docstrings); most tests run
the same code in process instead: helpers/inproc.py composes the config as the entry does and runs
the training loop on one rank here, helpers/ranks.py runs a function on several real gloo ranks in
worker processes kept for the session.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

# Hydra scans for plugins once per process, at the first composition: the checkout's
# src/hydra_plugins (hydra/launcher=ray, hydra/sweeper=optuna) must be on its path before
# any test composes, whatever the order the tests run in.
from hydra_ddp.launch.command import find_own_plugins  # noqa: E402

find_own_plugins()

# The overrides test jobs start from, run on the command line or in process (helpers/inproc.py)
# alike: no W&B, no progress bar.
FAST = ["logger=none", "trainer.progress=false"]


def user_env(tmp: Path, **extra: Optional[str]) -> dict[str, str]:
    """The environment of a user with no W&B account: offline, nothing read from $HOME."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "TORCHELASTIC_", "SLURM_", "SUBMITIT_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.update(
        NETRC=str(tmp / "no-netrc"),
        WANDB_CONFIG_DIR=str(tmp / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp / "wandb-data"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def wandb_env(tmp: Path, **extra: Optional[str]) -> dict[str, Optional[str]]:
    """user_env's W&B isolation, as the variables of an in-process run (helpers/ranks.py)."""
    return {
        "NETRC": str(tmp / "no-netrc"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb-data"),
        **extra,
    }


def run(
    cmd: list[str], cwd: Path, *, env: Optional[dict[str, str]] = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run a command as a user would; a hang past `timeout` fails the test."""
    return subprocess.run(
        cmd, cwd=cwd, env=env or user_env(cwd), capture_output=True, text=True, timeout=timeout
    )


def torchrun(
    cwd: Path,
    *overrides: str,
    nproc: int = 2,
    env: Optional[dict[str, str]] = None,
    timeout: float = 180,
    extra_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node=N -m hydra_ddp.train overrides...`"""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *extra_args,
        "-m",
        "hydra_ddp.train",
        *overrides,
    ]
    return run(cmd, cwd, env=env, timeout=timeout)


def python_train(
    cwd: Path, *overrides: str, env: Optional[dict[str, str]] = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """`python -m hydra_ddp.train overrides...` (single process, or self-launch / multirun)."""
    return run([sys.executable, "-m", "hydra_ddp.train", *overrides], cwd, env=env, timeout=timeout)


def start_logged(cmd: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """`cmd` started in its own session (a test signals its group), tests/ importable (the
    helpers' models and callbacks), stdout and stderr in <tmp_path>/console.log."""
    env = user_env(tmp_path)
    env["PYTHONPATH"] += os.pathsep + str(TESTS)
    out = tmp_path / "console.log"
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    return proc, out


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n"
        f"{proc.stderr[-6000:]}"
    )
    return proc


def job_dirs(root: Path) -> list[Path]:
    """Every job output dir under root (a dir holding summary.json or .hydra/)."""
    found = {p.parent for p in root.rglob("summary.json") if p.parent.name != "stats"}
    found |= {p.parent for p in root.rglob(".hydra")}
    return sorted(found)


def only_job_dir(root: Path) -> Path:
    dirs = job_dirs(root / "outputs")
    assert len(dirs) == 1, f"expected one job dir, found {dirs}"
    return dirs[0]


def summary(job_dir: Path) -> dict:
    return json.loads((job_dir / "summary.json").read_text())


def make_synthetic(out: Path, *args: str) -> Path:
    """scripts/make_synthetic.py --out OUT ARGS..., in process (its main(argv))."""
    spec = importlib.util.spec_from_file_location(
        "make_synthetic", REPO / "scripts" / "make_synthetic.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(out), *args]) == 0
    return out


@pytest.fixture
def synthetic(tmp_path: Path):
    """A factory writing a small synthetic data set under tmp_path with make_synthetic.py."""

    def make(name: str = "syn", *args: str) -> Path:
        return make_synthetic(tmp_path / name, *args)

    return make


@pytest.fixture(scope="session", autouse=True)
def _rank_workers():
    """The worker processes of helpers/ranks.py, stopped at the end of the session."""
    yield
    # Looked up, not imported: a session that never used ranks starts none. The workers are
    # not daemons (a rank may start DataLoader workers), so a pool left running would keep
    # pytest waiting at exit.
    if "helpers.ranks" in sys.modules:
        sys.modules["helpers.ranks"].shutdown()
    # Whatever child process a failed test left (a CI run once sat at exit on two): pytest's
    # exit would wait on it for ever, where the failure should be reported at once.
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)


@pytest.fixture(autouse=True)
def _stop_signals_left_as_found():
    """A test that leaves a stop signal's handler changed fails, and the handler is put back.
    A disposition set to "ignore" is inherited by every process the later tests start: a batch
    script started by a later test could then no longer trap SLURM's USR1."""
    import signal

    from hydra_ddp.launcher_env import STOP_SIGNALS

    sigs = [getattr(signal, name) for name in STOP_SIGNALS]
    before = {sig: signal.getsignal(sig) for sig in sigs}
    yield
    changed = [sig.name for sig in sigs if signal.getsignal(sig) is not before[sig]]
    for sig in sigs:
        signal.signal(sig, before[sig])
    assert not changed, f"the test left the handlers of {', '.join(changed)} changed"
