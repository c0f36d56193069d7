"""A planted mistake for `python -m hydra_ddp.check` (tests/test_check.py): a callback whose
state does not resume: its load_state_dict keeps the count it has instead of the saved one.
`+callbacks.seen._target_=helpers.forgetful_callback.SeenRows` (tests/ on PYTHONPATH)."""

from __future__ import annotations


class SeenRows:
    def __init__(self) -> None:
        self.rows = 0

    def on_step_end(self, ctx) -> None:
        self.rows += sum(len(b[0]) for b in ctx.batch)

    def state_dict(self) -> dict:
        return {"rows": self.rows}

    def load_state_dict(self, state: dict) -> None:
        self.rows = state.get("row_count", 0)  # a key it never saved
