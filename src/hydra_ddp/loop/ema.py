"""`trainer.ema_decay`: an exponential moving average of the weights, evaluated and checkpointed
while the raw weights keep training.

torch's `AveragedModel` keeps its update count in a tensor and compares it on every update: a
host-device sync per step on a GPU (or a blocking copy, with the count on the CPU). Here the
count is a Python int and the update is torch's own EMA function over all tensors at once, so
an update only queues kernels. The checkpoint keeps `AveragedModel`'s layout (`module.<name>`,
`n_averaged`), so checkpoints written before this class load unchanged.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from hydra_ddp.distributed.fsdp import local, reshard


class EMA:
    """The averaged copy of `model`: `update(model)` after each optimizer step, `module` to
    evaluate. The first update copies the weights (as AveragedModel does)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        self.decay = decay
        self.n_averaged = 0
        self._average = get_ema_multi_avg_fn(decay)

    def _pairs(self, model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Buffers too (BatchNorm's running statistics), as AveragedModel(use_buffers=True).
        mine = [*reshard(self.module).parameters(), *self.module.buffers()]
        theirs = [*reshard(model).parameters(), *model.buffers()]
        # ddp=fsdp2: both are sharded alike, so each rank averages its own shards.
        return [(local(a).detach(), local(b).detach()) for a, b in zip(mine, theirs)]

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        pairs = self._pairs(model)
        if self.n_averaged == 0:
            for mine, theirs in pairs:
                mine.copy_(theirs)
        else:
            floats = [(a, b) for a, b in pairs if a.is_floating_point()]
            if floats:
                self._average([a for a, _ in floats], [b for _, b in floats], None)
            for mine, theirs in pairs:  # integer buffers (batch counts): the latest value
                if not mine.is_floating_point():
                    mine.copy_(theirs)
        self.n_averaged += 1

    def state_dict(self) -> dict[str, Any]:
        state = {f"module.{k}": v for k, v in self.module.state_dict().items()}
        state["n_averaged"] = torch.tensor(self.n_averaged, dtype=torch.long)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = {k[len("module.") :]: v for k, v in state.items() if k.startswith("module.")}
        self.module.load_state_dict(weights)
        self.n_averaged = int(state["n_averaged"])
