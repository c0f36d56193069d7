"""A user's callbacks, outside the package (tests/ is on sys.path): what `+callbacks.NAME.
_target_=helpers.user_callbacks.Count` points at in test_callbacks.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Count:
    """Counts each hook; writes the counts of its rank to <output dir>/count_rank<r>.json at the
    end, and logs a running count with ctx.log at every step."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.counts = {"train_start": 0, "step_end": 0, "epoch_end": 0, "eval_end": 0}
        self.epochs: list[int] = []
        self.steps: list[int] = []

    def on_train_start(self, ctx) -> None:
        self.counts["train_start"] += 1

    def on_step_end(self, ctx) -> None:
        self.counts["step_end"] += 1
        self.steps.append(ctx.step)
        if ctx.step % self.every == 0:
            ctx.log(
                {"callback_steps": self.counts["step_end"], "rank_plus_step": ctx.rank + ctx.step}
            )

    def on_epoch_end(self, ctx) -> None:
        self.counts["epoch_end"] += 1
        self.epochs.append(ctx.epoch)

    def on_eval_end(self, ctx) -> None:
        assert "val/loss" in ctx.metrics
        self.counts["eval_end"] += 1

    def on_train_end(self, ctx) -> None:
        assert "test/loss" in ctx.metrics and "val/loss" in ctx.metrics
        out = Path(ctx.output_dir) / f"count_rank{ctx.rank}.json"
        out.write_text(json.dumps({**self.counts, "epochs": self.epochs, "steps": self.steps}))

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "epochs": list(self.epochs), "steps": list(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        self.counts, self.epochs, self.steps = state["counts"], state["epochs"], state["steps"]


class Boom:
    def on_step_end(self, ctx) -> None:
        if ctx.step == 3:
            raise ValueError("boom at three")


class NoHooks:
    pass


class SignalAt:
    """Sends this process `signal` at the end of step `at`: SIGTERM as a scheduler would,
    SIGKILL as a dead node would."""

    def __init__(self, at: int, signal: str = "SIGTERM") -> None:
        self.at, self.signal = at, signal

    def on_step_end(self, ctx) -> None:
        if ctx.step == self.at:
            import os
            import signal

            os.kill(os.getpid(), getattr(signal, self.signal))


class TokenMLP:
    """Stands in for a model whose constructor takes a credential (a hub token)."""

    def __new__(cls, in_features: int, out_features: int, api_token: str):
        from hydra_ddp.models import MLP

        assert api_token  # the real value reaches the model
        return MLP(in_features, out_features, hidden=16, depth=1, dropout=0.0)


class Note:
    """A user's object: whatever `value` holds, checkpointed as is; `restored` once loaded."""

    def __init__(self, value: Any = None) -> None:
        self.value, self.restored = value, False

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.restored = state["value"], True


class Notes:
    """Two Notes of the user's, neither a callback's own state nor a loop part, put into every
    checkpoint by `checkpoint_members()`: a global one (rank 0's) and a per-rank one (`mine`,
    suffixed with the rank at the start). At the start, after any resume, writes what the
    resume put into them to <output dir>/notes_rank<r>.json."""

    def __init__(self, shared: Any = None, mine: Any = None, required: bool = False) -> None:
        self.shared, self.mine, self.required = Note(shared), Note(mine), required

    def checkpoint_members(self) -> list:
        from hydra_ddp.checkpoint.state import Member

        return [
            Member("note", lambda objects: self.shared, required=self.required),
            Member("my_note", lambda objects: self.mine, per_rank=True),
        ]

    def on_train_start(self, ctx) -> None:
        if self.mine.value is not None and not self.mine.restored:
            self.mine.value = f"{self.mine.value} of rank {ctx.rank}"
        notes = {"shared": self.shared, "mine": self.mine}
        restored = {name: note.value for name, note in notes.items() if note.restored}
        (Path(ctx.output_dir) / f"notes_rank{ctx.rank}.json").write_text(json.dumps(restored))
