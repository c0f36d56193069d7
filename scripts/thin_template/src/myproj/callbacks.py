"""Work of your own at points of the loop, without editing it.

A callback is any object with some of the engine's hook methods (`hydra_ddp.api.HOOKS`:
on_train_start, on_before_optimizer_step, on_step_end, on_eval_end, on_epoch_end,
on_train_end), each given a `Context`; `ctx.log({...})` puts values in this rank's stats at the
current step. Callbacks run on every rank; `state_dict` / `load_state_dict`, if present, are
saved in every checkpoint. They are listed under `callbacks:` in conf/myproj.yaml.
"""

from __future__ import annotations

import torch
from hydra_ddp.api import Context


class WeightNorm:
    """Logs the model's total weight norm every `every` optimizer steps (as `weight_norm`)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_step_end(self, ctx: Context) -> None:
        if ctx.step % self.every == 0:
            with torch.no_grad():
                norms = torch.stack([p.detach().float().norm() for p in ctx.model.parameters()])
            ctx.log({"weight_norm": norms.norm()})
