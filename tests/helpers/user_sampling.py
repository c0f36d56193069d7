"""A user's sampler policy (tests/ is on sys.path): `sampler._target_=helpers.user_sampling.
Backwards` in process, and copied as my_sampling.py next to a YAML for the real launch of
test_user_policy_and_hook.py. Standalone on purpose: a user's module imports only the
package's public policy classes."""

from hydra_ddp.data.policies import Strided
from hydra_ddp.data.sampling import StridedSampler


class BackwardsSampler(StridedSampler):
    """Strided's positions counted from the end; each batch handed out is appended to
    `record`, one line of row numbers per batch."""

    def __init__(self, *args, record: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = record

    def _rows(self, sample_ids, order):
        return self.num_rows - 1 - super()._rows(sample_ids, order)

    def __iter__(self):
        for batch in super().__iter__():
            with open(self.record, "a") as f:
                f.write(" ".join(map(str, batch.tolist())) + "\n")
            yield batch


class Backwards(Strided):
    name = "backwards"

    def __init__(self, drop_last: bool, record_dir: str):
        super().__init__(shuffle=False, seed=0, drop_last=drop_last)
        self.record_dir = record_dir

    def sampler(self, rows_held, rank_ranges, rank, world, batch_size):
        return BackwardsSampler(
            rows_held, rank, world, batch_size, shuffle=False, drop_last=self.drop_last,
            record=f"{self.record_dir}/rank{rank}.txt",
        )  # fmt: skip

    def settings(self):
        # The name it was imported by: helpers.user_sampling here, my_sampling when copied.
        target = f"{type(self).__module__}.{type(self).__qualname__}"
        return {"_target_": target, "drop_last": self.drop_last, "record_dir": self.record_dir}
