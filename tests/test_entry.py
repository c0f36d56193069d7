"""The entry of a thin project: `hydra_ddp.train.main(config_path, config_name)` composes from
the project's own config dir, layered over the engine's (its searchpath), and trains with it as
`python -m hydra_ddp.train` does: the project's value wins, a key unknown to both is refused in
one line, the job and its log are named `train`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, ok, run

from hydra_ddp.launch.command import config_dir
from hydra_ddp.train import main

PROJECT = """\
defaults:
  - train
  - _self_
hydra:
  searchpath: [file://{engine}]
trainer:
  seed: 1234
"""
MAIN = "from hydra_ddp.train import main; main(config_path={path!r}, config_name='mine')"


def _project(tmp_path: Path) -> Path:
    conf = tmp_path / "myconf"
    conf.mkdir()
    (conf / "mine.yaml").write_text(PROJECT.format(engine=config_dir()))
    return conf


def test_main_composes_from_a_project_config_dir(tmp_path, monkeypatch, capsys) -> None:
    conf = _project(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mine", "--cfg", "job", "trainer.max_steps=3"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # find_own_plugins may add src/ to it
    with pytest.raises(SystemExit) as stopped:
        main(config_path=str(conf), config_name="mine")
    assert stopped.value.code == 0
    printed = capsys.readouterr().out
    assert "seed: 1234" in printed and "max_steps: 3" in printed, printed[-2000:]


@pytest.mark.slow  # two interpreters that import torch
def test_main_composes_from_a_project_config_dir_and_trains(tmp_path: Path) -> None:
    _project(tmp_path)
    out = tmp_path / "run"
    # A relative config_path is read from the working dir.
    cmd = [sys.executable, "-c", MAIN.format(path="myconf"), *FAST, "trainer.max_steps=2",
           f"hydra.run.dir={out}"]  # fmt: skip
    ok(run(cmd, tmp_path))
    saved = (out / ".hydra" / "config.yaml").read_text()
    assert "seed: 1234" in saved, "the project's value over the engine's"
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "train.log").is_file(), "the job is named train, whatever module calls main"

    cmd = [sys.executable, "-c", MAIN.format(path=str(tmp_path / "myconf")), "no_such_key=1"]
    proc = run(cmd, tmp_path)
    assert proc.returncode == 2 and "no_such_key" in proc.stderr.strip().splitlines()[-1]


# What a sweep's launching process imports before it hands out a job: the command, Hydra's
# plugins (every launcher and sweeper installed: Hydra's scan imports them all), the sweep
# report callback, the log filter, and the Ray launcher's and Optuna sweeper's own modules (the
# sweeper's where the sweep extra is installed: without it, the sweep stops with one line).
DRIVER_IMPORTS = """\
import importlib, importlib.util, sys
import hydra_ddp.train
from hydra_ddp.launch.command import find_own_plugins
find_own_plugins()
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
found = [c.__name__ for kind in (Launcher, Sweeper) for c in Plugins.instance().discover(kind)]
names = ["hydra_ddp.rundir.sweeps", "hydra_ddp.redact",
         "hydra_plugins.hydra_ddp_ray_launcher._sweep"]
if importlib.util.find_spec("optuna"):
    names.append("hydra_plugins.hydra_ddp_optuna._study")
for name in names:
    importlib.import_module(name)
print(sorted(found))
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""


def test_a_sweeps_launching_process_imports_no_torch() -> None:
    """A sweep on Ray or SLURM runs its jobs elsewhere: its own process imports no torch, so
    its first job is handed out seconds sooner (tests/test_ray_sweeps.py checks a real one)."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER_IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plugins, torch_modules = proc.stdout.strip().splitlines()[-2:]
    assert "RayLauncher" in plugins and "OptunaSweeper" in plugins, plugins
    assert torch_modules == "[]", torch_modules
