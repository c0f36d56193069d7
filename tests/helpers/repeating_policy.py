"""A planted mistake for `python -m hydra_ddp.check` (tests/test_check.py): a sampler policy
subclass that hands every rank the same rows (rank 0's), so each epoch trains on half the data
twice. `sampler._target_=helpers.repeating_policy.SameRowsEverywhere` (tests/ on PYTHONPATH)."""

from __future__ import annotations

from hydra_ddp.data.policies import Strided


class SameRowsEverywhere(Strided):
    def sampler(self, rows_held, rank_ranges, rank, world, batch_size):
        return super().sampler(rows_held, rank_ranges, 0, world, batch_size)  # rank forgotten
