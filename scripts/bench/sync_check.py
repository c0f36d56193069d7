"""A callback for scripts/bench/gpu_check.sh: CUDA's sync debug mode set to "error" over the
steps between two log intervals, so any host-device synchronisation there raises.

    +callbacks.sync._target_=sync_check.SyncDebug +callbacks.sync.log_interval=10
    (with scripts/bench on PYTHONPATH, trainer.eval_interval=0 and trainer.ckpt_interval=0)

The log interval itself reads the loss and the stats back (one sync, by design), so the mode is
off for the step that ends on it."""

from __future__ import annotations

import torch


class SyncDebug:
    def __init__(self, log_interval: int) -> None:
        self.log_interval = log_interval
        self.checked_steps = 0

    def on_step_end(self, ctx) -> None:
        if ctx.step % self.log_interval == 0:  # just logged: watch the steps until the next
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        elif (ctx.step + 1) % self.log_interval == 0:  # the next step logs
            torch.cuda.set_sync_debug_mode(0)
            self.checked_steps += self.log_interval - 1
            ctx.log({"sync_free_steps": self.checked_steps})

    def on_train_end(self, ctx) -> None:
        torch.cuda.set_sync_debug_mode(0)
        print(f"sync check: {self.checked_steps} steps ran with no host-device sync")
