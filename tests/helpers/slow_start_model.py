"""A test-only model whose constructor sleeps in a worker: a job still starting up (a large model
being built, weights being read) when the user presses Ctrl-C or the launcher is signalled.

Used as `model=mlp model._target_=helpers.slow_start_model.SlowStartMLP +model.start_s=30`
(tests/ on PYTHONPATH). The launching process builds the model too (its checks before the
workers start), where it does not sleep: only a process started by a launcher (LOCAL_RANK set)
does.
"""

from __future__ import annotations

import os
import time

from hydra_ddp.models import MLP


class SlowStartMLP(MLP):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        hidden: int,
        depth: int,
        dropout: float,
        start_s: float = 30.0,
    ):
        if "LOCAL_RANK" in os.environ:
            # A mark in the working dir: this rank is past its imports, building the model.
            open(f"building_rank{os.environ['LOCAL_RANK']}", "w").close()
            time.sleep(start_s)
        super().__init__(in_features, out_features, hidden, depth, dropout)
