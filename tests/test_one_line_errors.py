"""Small mistakes that used to give tracebacks or wrong advice, each now one line that says
what to do: a quoted `hydra.run.dir='...'`, a forward that returns a tuple, Ctrl-C while a
self-launched job starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST, user_env

from hydra_ddp.batches import BatchLoss
from hydra_ddp.errors import UserError, needs_package
from hydra_ddp.losses import CrossEntropy


def test_a_quoted_run_dir_makes_no_stray_quoted_tree(tmp_path: Path, monkeypatch) -> None:
    """Previously: `"hydra.run.dir='out/a b'"` made `'out/a b'` (quotes and all) in the working
    directory before Hydra, which reads the value without its quotes, ran in `out/a b`."""
    from hydra_ddp.launch import command as overrides

    monkeypatch.chdir(tmp_path)
    overrides.check_command_line(["hydra.run.dir='out/a b'", "trainer.max_steps=1"], [])
    assert (tmp_path / "out" / "a b").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_forward_returning_a_tuple_says_what_the_loss_expects() -> None:
    """Previously: the loss's own TypeError/AttributeError deep in torch, as a traceback."""
    objective = BatchLoss(CrossEntropy(0.0))
    batch = (torch.zeros(4, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(UserError) as e:
        objective((torch.zeros(4, 3), torch.zeros(4)), batch)
    line = str(e.value)
    assert "a tuple of 2" in line and "expects one tensor" in line and "\n" not in line


@pytest.mark.slow  # a real self-launched job interrupted while it starts
@pytest.mark.timeout(300)
def test_ctrl_c_while_workers_start_says_there_is_nothing_to_resume(tmp_path: Path) -> None:
    """Previously: a traceback of the launching process, and advice to resume from a
    checkpoint that did not exist."""
    cmd = [sys.executable, "-m", "hydra_ddp.train", *FAST, "dist.nproc_per_node=2",
           f"hydra.run.dir={tmp_path / 'job'}"]  # fmt: skip
    out = tmp_path / "out.log"
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=user_env(tmp_path), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 200
    while "starting 2 workers" not in out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-2000:]
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
    assert proc.wait(timeout=120) == 128 + signal.SIGINT
    text = out.read_text()
    assert "before any checkpoint was written: nothing to resume" in text, text[-3000:]
    assert "to resume from its newest checkpoint" not in text


def test_a_component_whose_library_is_missing_says_what_to_install() -> None:
    """Previously: a ModuleNotFoundError traceback from inside the component's constructor."""
    from hydra_ddp.components import build

    with pytest.raises(UserError) as e:
        build({"_target_": "helpers.needs_missing.model"}, "model", in_features=4, out_features=2)
    assert str(e.value) == (
        "model (helpers.needs_missing.model) needs transformers_not_installed_anywhere, which is "
        "not installed here: pip install transformers_not_installed_anywhere"
    )
    for module, extra in [
        ("optuna.samplers", "sweep"),
        ("ray", "ray"),
        ("transformers", "transformers"),
    ]:
        assert f'pip install -e ".[{extra}]"' in str(needs_package("x", module))


def test_a_sweep_under_torchrun_is_refused_before_any_rank_takes_the_sweep_dir(
    tmp_path: Path,
) -> None:
    """Every rank would start the sweep and race for its dir (the loser said the dir was in
    use, the winner left a half-made job): the command line is refused on every rank first."""
    sweep = f"hydra.sweep.dir={tmp_path / 'sw'}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "hydra_ddp.train", "-m", "model=mlp,cnn", sweep]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=user_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    refusals = {line for line in proc.stderr.splitlines() if line.startswith("error: ")}
    # Said by each rank that gets there before torchrun stops the others on the first's exit.
    assert refusals == {"error: a sweep (-m) under torchrun would run the whole sweep on every "
                        "rank: run `python -m hydra_ddp.train -m dist.nproc_per_node=N ...` "
                        "instead"}, proc.stderr[-3000:]  # fmt: skip
    assert "in use" not in proc.stderr and not (tmp_path / "sw").exists()
