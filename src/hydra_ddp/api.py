"""The engine's public API: the whole surface a thin project may import, and nothing else.

A thin project (`python scripts/new_project.py myproj`) keeps its model, data, loss and
callbacks in a package of its own and imports from the engine only `hydra_ddp.api`. The names
below are kept, with their meaning, across releases of hydra-ddp; every other module of the
package may change between versions, so a project that reaches past this module can break on
`pip install -U hydra-ddp`. Configs are the other half of the contract: the engine's groups and
keys (conf/, the typed `trainer`, `dist`, `ddp`, `logger`) are reached with
`hydra.searchpath: [pkg://hydra_ddp.conf]` in the project's primary config.

Running:

* `main(config_path, config_name)`: the training entry. `python -m myproj.train` calls it with
  the project's conf dir; it composes `config_name` there (layered over the engine's configs),
  validates it, and trains in this process (one rank under torchrun) or starts
  `dist.nproc_per_node` workers.
* `compose(config_path, config_name, overrides)`: the same composition without training, typed
  and checked (`TrainConfig`), for tests; `build(node, key, **runtime)` builds one component of
  it (`build(cfg.data, "data")`) with the engine's one-line errors for a bad argument.
* `run_checks(config_path, config_name)`: `python -m hydra_ddp.check` with the project's configs:
  short real runs of its training with the command line's overrides, checked for rank
  agreement, exact resume, rows, determinism, gradient sync and the checkpoint's round trip
  (docs/check.md); exits 0 only if every check that ran passed.

What a project implements (every contract, method by method and with its rank rules, is a
class of `protocols`, the engine's `hydra_ddp.protocols`):

* data: `DataSource` (`num_rows`, `load`, `spec`); `InMemoryArrays` (arrays in RAM: set
  `arrays` and `spec`), `Rows` and `TokenWindows` (what `load` returns for arrays),
  `TorchDatasets` (map-style torch Datasets as they are);
* callbacks: any object with some of the methods in `HOOKS`, each given a `Context`
  (`ctx.log({...})` adds values to this rank's stats), and `checkpoint_members()` returning
  `Member`s for state of yours every checkpoint holds;
* metrics: `Metric` (`sums`, `compute`; `Accuracy` is a worked one);
* losses: any callable; `CrossEntropy` and `ModelOutput` are the engine's;
* a step of your own: `StepTools` (`backward`, `step`), as the engine's `default_step` uses it;
* errors: raise `UserError` for bad input; the engine shows it as one `error:` line.

Distributed: `DistEnv` (rank, world size, device, `is_main`), `all_gather_with_grad` (every
rank's rows, with gradients, for a loss) and `gather_for_metrics` (every rank's rows, padding
left out, for a metric that sets `gathers = True`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hydra import compose as _compose
from hydra import initialize_config_dir

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
from hydra_ddp.launch.command import config_dir, find_own_plugins
from hydra_ddp.launch.runner import to_typed
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
    conf = str(Path(config_path).resolve()) if config_path is not None else config_dir()
    find_own_plugins()  # before Hydra's one plugin scan per process: hydra/launcher=ray, ...
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return to_typed(_compose(config_name, overrides=list(overrides)))
