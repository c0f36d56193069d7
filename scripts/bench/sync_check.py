"""A callback for scripts/bench/gpu_check.sh: CUDA's sync debug mode set to "error" over the
steps between two log intervals, so any host-device synchronisation there raises.

    +callbacks.sync._target_=sync_check.SyncDebug
    '+callbacks.sync.log_interval=${trainer.log_interval}'
    '+callbacks.sync.max_steps=${trainer.max_steps}'
    (with scripts/bench on PYTHONPATH, trainer.eval_interval=0 and trainer.ckpt_interval=0)

A log step reads the loss and the stats back (one sync, by design), and so does everything after
the last step (the final health check, evaluation, the summary): the mode is "error" only from
the step after a log step to the step before the next one, and only where that next log step
comes before the run's end. Without CUDA the same windows are kept (`armed_steps`), with no
mode to set: a CPU run checks the schedule, a GPU run checks the steps.
"""

from __future__ import annotations

import torch


class SyncDebug:
    def __init__(self, log_interval: int, max_steps: int) -> None:
        self.log_interval = log_interval
        self.max_steps = max_steps
        self.armed = False
        self.armed_steps: list[int] = []  # the steps that ran under "error"
        self.checked_steps = 0

    def after_step(self, step: int) -> bool | None:
        """After step `step`: True to arm for the steps that follow, False to disarm before
        the next one (a log step), None to leave the mode as it is."""
        if self.log_interval < 2:
            return None  # every step logs: no step between two log steps to check
        if step % self.log_interval == 0 and step + self.log_interval <= self.max_steps:
            return True  # just logged, and the next log step is not past the end
        if self.armed and (step + 1) % self.log_interval == 0:
            return False
        return None

    def on_step_end(self, ctx) -> None:
        if self.armed:
            self.armed_steps.append(ctx.step)
        change = self.after_step(ctx.step)
        if change is None:
            return
        self.armed = change
        if torch.cuda.is_available():
            if change:
                torch.cuda.synchronize()  # the log step's work done before the check starts
            torch.cuda.set_sync_debug_mode("error" if change else "default")
        if not change:
            self.checked_steps += self.log_interval - 1
            ctx.log({"sync_free_steps": self.checked_steps})

    def on_train_end(self, ctx) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        where = "CUDA sync debug mode 'error'" if torch.cuda.is_available() else "no CUDA"
        print(
            f"sync check: {self.checked_steps} steps ran with no host-device sync ({where}; "
            f"armed over steps {self.armed_steps[:1]}..{self.armed_steps[-1:]}, "
            f"disarmed at the end: {not self.armed})",
            flush=True,
        )
