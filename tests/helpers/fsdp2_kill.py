"""A test-only callback that SIGKILLs its own rank at the end of a chosen step (tests/ is on
sys.path): `+callbacks.kill._target_=helpers.fsdp2_kill.KillAtStep +callbacks.kill.step=N`."""

from __future__ import annotations

import os
import signal


class KillAtStep:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, ctx) -> None:
        if ctx.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
