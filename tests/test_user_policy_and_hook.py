"""A sampler policy and a DDP comm hook of the user's, each one module and one YAML outside the
package, chosen by `_target_` alone (`sampler=backwards`, `ddp=counting`) and trained on 2 real
gloo ranks by the real entry (`python -m hydra_ddp.train dist.nproc_per_node=2`), in one launch.

The policy reads Strided's positions from the end of the split and records the rows it hands
out; the test computes the rows each rank must get on its own and compares. The hook averages
the gradients as DDP's default all-reduce does and counts its calls in its state, which the
checkpoint keeps per rank: both ranks' counts show it ran on both."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from conftest import FAST, ok, only_job_dir, python_train, summary, user_env

from hydra_ddp import checkpoint

SAMPLING = '''
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
                    f.write(" ".join(map(str, batch.tolist())) + "\\n")
                yield batch


    class Backwards(Strided):
        name = "backwards"

        def __init__(self, drop_last: bool, record_dir: str):
            super().__init__(shuffle=False, seed=0, drop_last=drop_last)
            self.record_dir = record_dir

        def sampler(self, rows_held, parts, rank, world, batch_size):
            return BackwardsSampler(
                rows_held, rank, world, batch_size, shuffle=False, drop_last=self.drop_last,
                record=f"{self.record_dir}/rank{rank}.txt",
            )

        def settings(self):
            return {"_target_": "my_sampling.Backwards", "drop_last": self.drop_last,
                    "record_dir": self.record_dir}
    '''

HOOKS = '''
    import torch.distributed as dist


    class CountingMean:
        """The mean of the ranks' gradients, as DDP's default all-reduce; counts its calls."""

        def __init__(self, note: str):
            self.state = {"calls": 0, "note": note}

        def hook(self, state, bucket):
            state["calls"] += 1
            grads = bucket.buffer().div_(dist.get_world_size())
            done = dist.all_reduce(grads, async_op=True).get_future()
            return done.then(lambda fut: fut.value()[0])

        def state_dict(self):
            return {"calls": self.state["calls"]}

        def load_state_dict(self, saved):
            self.state["calls"] = int(saved["calls"])
    '''


def _user(tmp_path: Path, files: dict[str, str], yamls: dict[str, str]) -> dict[str, str]:
    """Write the user's modules and YAMLs under tmp_path; the environment that imports them."""
    code_dir, conf = tmp_path / "mine", tmp_path / "my_conf"
    code_dir.mkdir(exist_ok=True)
    for module, code in files.items():
        (code_dir / module).write_text(textwrap.dedent(code))
    for yaml_path, yaml in yamls.items():
        (conf / yaml_path).parent.mkdir(parents=True, exist_ok=True)
        (conf / yaml_path).write_text(yaml)
    env = user_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(code_dir), env["PYTHONPATH"]])
    return env


def test_a_user_sampler_policy_and_comm_hook_train_two_ranks_by_yaml_alone(
    tmp_path: Path,
) -> None:
    """One real launch holds both (each is one module and one YAML): the rows each rank read are
    the policy's, and the hook ran on both ranks."""
    env = _user(
        tmp_path,
        {"my_sampling.py": SAMPLING, "my_hooks.py": HOOKS},
        {
            "sampler/backwards.yaml": "_target_: my_sampling.Backwards\ndrop_last: false\n"
            "record_dir: ???\n",
            "ddp/counting.yaml": "comm_hook:\n  _target_: my_hooks.CountingMean\n  note: mine\n",
        },
    )
    record = tmp_path / "rows"
    record.mkdir()
    ok(
        python_train(
            tmp_path,
            "--config-dir",
            str(tmp_path / "my_conf"),
            "dist.nproc_per_node=2",
            *FAST,
            "sampler=backwards",
            f"sampler.record_dir={record}",
            "ddp=counting",
            "trainer.batch_size=128",
            "trainer.max_steps=6",
            "trainer.log_interval=2",
            env=env,
            timeout=240,
        )  # fmt: skip
    )
    job = only_job_dir(tmp_path)
    s = summary(job)
    assert s["steps"] == 6 and s["sampler"] == "backwards"
    # The policy: positions rank, rank + 2, ... (wrapping for the padding) from the end.
    n = s["rows_held_per_rank"][0]  # strided: every rank holds the whole split
    per_rank = -(-n // 2)  # DistributedSampler's padded share
    for rank in (0, 1):
        epoch = [n - 1 - ((rank + 2 * i) % n) for i in range(per_rank)]
        batches = [epoch[i : i + 128] for i in range(0, per_rank, 128)]
        got = [list(map(int, ln.split())) for ln in (record / f"rank{rank}.txt").open()]
        assert len(got) >= 6, len(got)
        # 5 batches an epoch: the second epoch reads the same order from its start.
        assert len(batches) == 5 and got[:6] == (batches + batches)[:6]
    # The hook: built by DDP's wrap on each rank, its state saved by each rank.
    assert "comm_hook=CountingMean" in (job / "train_rank0.log").read_text()
    saved = checkpoint.load(checkpoint.latest(job))["rng"]
    for rank in (0, 1):
        # One call per gradient bucket and step at least.
        assert saved[rank]["comm_hook"]["calls"] >= 6, saved[rank]["comm_hook"]
        rows = [json.loads(ln) for ln in (job / "stats" / f"rank{rank}.jsonl").open()]
        assert rows[-1]["loss"] < rows[0]["loss"]
