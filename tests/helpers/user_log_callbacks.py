"""A user's callbacks that log with ctx.log (tests/ is on sys.path): every rank's values, and
the values ctx.log refuses."""

from __future__ import annotations

from typing import Any

import torch


class LogEveryRank:
    """Logs, on every rank at every step, a number that names the rank and the step, a
    one-element tensor and a line of text."""

    def on_step_end(self, ctx) -> None:
        ctx.log(
            {
                "rank_step": 100 * ctx.rank + ctx.step,
                "half": torch.tensor([0.5]),
                "note": f"rank {ctx.rank} step {ctx.step}",
            }
        )


class LogValue:
    """Logs `{key: value}` at step 2 (value: a list, `tensor` for a 3-element tensor, or 1)."""

    def __init__(self, key: str, value: Any = 1) -> None:
        self.key = key
        self.value = torch.ones(3) if value == "tensor" else value

    def on_step_end(self, ctx) -> None:
        if ctx.step == 2:
            ctx.log({self.key: self.value})
