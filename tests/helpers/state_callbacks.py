"""A user's callbacks whose state_dict holds numpy values or an object of their own (tests/ is on
sys.path): what test_checkpoint_state.py points `+callbacks.NAME._target_` at."""

from __future__ import annotations

import numpy as np


class NumpyState:
    """Keeps its running numbers as numpy values, as code using numpy does without thinking.
    `NumpyState.loaded`: what the last load_state_dict got (in process)."""

    loaded: dict | None = None

    def __init__(self) -> None:
        self.mean, self.count, self.history = np.float64(0.0), np.int64(0), np.zeros(3)

    def on_step_end(self, ctx) -> None:
        self.count += 1
        self.mean = np.float64(self.mean + (float(ctx.loss) - self.mean) / self.count)
        self.history = np.roll(self.history, 1)
        self.history[0] = ctx.step

    def state_dict(self) -> dict:
        return {"mean": self.mean, "count": self.count, "history": self.history,
                "nested": {"pair": (np.int64(1), np.float32(0.5))}}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.count = np.float64(state["mean"]), np.int64(state["count"])
        self.history = np.asarray(state["history"])
        NumpyState.loaded = state


class Opaque:
    """An object of the user's own: no plain type can stand for it."""


class OpaqueState:
    def on_step_end(self, ctx) -> None:
        pass

    def state_dict(self) -> dict:
        return {"ok": 1.0, "thing": Opaque()}

    def load_state_dict(self, state: dict) -> None:
        pass
