"""A callback that holds a job at its first step until a file appears (tests/ on PYTHONPATH):
`+callbacks.gate._target_=helpers.gate_callbacks.WaitForFile +callbacks.gate.path=<file>`, so a test
can do something while the job is surely running, then let it finish."""

from __future__ import annotations

import time
from pathlib import Path


class WaitForFile:
    def __init__(self, path: str, timeout_s: float = 600.0) -> None:
        self.path, self.timeout_s = Path(path), timeout_s

    def on_step_end(self, ctx) -> None:
        deadline = time.monotonic() + self.timeout_s
        while ctx.step == 1 and not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
