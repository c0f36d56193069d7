"""The engine's public API: the whole surface a thin project may import, and nothing else.

A thin project (`python scripts/new_project.py myproj`) keeps its model, data, loss and
callbacks in a package of its own and imports from the engine only `hydra_ddp.api`, whose
names keep their meaning across releases; every other module may change between versions.
Configs are the other half of the contract: the engine's groups and keys are reached with
`hydra.searchpath: [pkg://hydra_ddp.conf]` in the project's primary config.

Running: `main(config_path, config_name)` trains (`python -m myproj.train`);
`compose(config_path, config_name, overrides)` is the same composition, typed and checked
(`TrainConfig`), without training, for tests; `build(node, key, **runtime)` builds one component
of it with the engine's one-line errors; `run_checks(config_path, config_name)` is
`python -m hydra_ddp.check` with the project's configs (docs/check.md).

What a project implements (each contract, with its rank rules, is a class of `protocols`):
data: `DataSource`, `InMemoryArrays` (arrays in RAM), `Rows` and `TokenWindows` (what `load`
returns for arrays), `TorchDatasets` (map-style torch Datasets); callbacks: the methods in
`HOOKS`, each given a `Context`, and `checkpoint_members()` returning `Member`s; metrics:
`Metric` (`Accuracy` is a worked one); losses: any callable (`CrossEntropy`, `ModelOutput`);
a step of your own: `StepTools`, as `default_step` uses it; bad input: raise `UserError`.
Distributed: `DistEnv` (rank, world size, device, `is_main`), `all_gather_with_grad` (every
rank's rows, with gradients, for a loss) and `gather_for_metrics` (the same, padding left out,
for a metric that sets `gathers = True`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hydra_ddp import __version__, protocols
from hydra_ddp import check as _check
from hydra_ddp import train as _train
from hydra_ddp.callbacks import HOOKS, Context
from hydra_ddp.checkpoint.state import Member
from hydra_ddp.components import build
from hydra_ddp.config import TrainConfig
from hydra_ddp.data import DataSource, InMemoryArrays, Rows, TokenWindows, TorchDatasets
from hydra_ddp.distributed import DistEnv, all_gather_with_grad, gather_for_metrics
from hydra_ddp.errors import UserError
from hydra_ddp.launch.command import compose_typed
from hydra_ddp.losses import CrossEntropy, ModelOutput
from hydra_ddp.metrics import Accuracy, Metric
from hydra_ddp.step import StepTools, default_step

__all__ = [
    "HOOKS", "Accuracy", "Context", "CrossEntropy", "DataSource", "DistEnv", "InMemoryArrays",
    "Member", "Metric", "ModelOutput", "Rows", "StepTools", "TokenWindows", "TorchDatasets",
    "TrainConfig", "UserError", "__version__", "all_gather_with_grad", "build", "run_checks",
    "compose", "default_step", "gather_for_metrics", "main", "protocols",
]  # fmt: skip


def main(config_path: str | Path | None = None, config_name: str = "train") -> None:
    """Train with the command line's overrides: compose `config_name` from `config_path` (None:
    the engine's own configs), then train here or start the workers; exits with the job's
    status. A thin project's `train.py` calls it with its packaged conf dir."""
    _train.main(
        config_path=None if config_path is None else str(config_path), config_name=config_name
    )


def run_checks(config_path: str | Path | None = None, config_name: str = "train") -> None:
    """Check the training `main` would run, with the command line's overrides (`--only`,
    `--skip`, `--steps` too): `python -m hydra_ddp.check` composing `config_name` from
    `config_path`. A thin project's `myproj-check` calls it with its packaged conf dir."""
    _check.main(config_path=config_path, config_name=config_name)


def compose(
    config_path: str | Path | None = None,
    config_name: str = "train",
    overrides: Iterable[str] = (),
) -> TrainConfig:
    """The config `main` would train with, typed and checked, without training: for tests of a
    project's configs (`compose(conf, "myproj", ["trainer.max_steps=3"])`)."""
    return compose_typed(config_path, config_name, list(overrides))
