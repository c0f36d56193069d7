"""A sampler policy and a DDP comm hook of the user's, each one module and one YAML outside the
package, chosen by `_target_` alone (`sampler=backwards`, `ddp=counting`) and trained on 2
ranks: in process (helpers/ranks.py, the modules as helpers.user_sampling and
helpers.user_comm_hooks) and, slow, by the real entry (`python -m hydra_ddp.train
--config-dir ... dist.nproc_per_node=2`) with the same modules copied into a user's folder.

The policy reads Strided's positions from the end of the split and records the rows it hands
out; the test computes the rows each rank must get on its own and compares. The hook averages
the gradients as DDP's default all-reduce does and counts its calls in its state, which the
checkpoint keeps per rank: both ranks' counts show it ran on both."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest
from conftest import FAST, ok, only_job_dir, python_train, summary, user_env
from helpers.inproc import train_here, train_ranks

from hydra_ddp import checkpoint

HELPERS = Path(__file__).parent / "helpers"
RUN = [*FAST, "trainer.batch_size=128", "trainer.max_steps=6", "trainer.log_interval=2"]


def _check(job: Path, record: Path, s: dict, rank0_log: str) -> None:
    """The rows each rank read are the policy's, and the hook ran (and was saved) on both."""
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
    assert "comm_hook=CountingMean" in rank0_log
    saved = checkpoint.load(checkpoint.latest(job))["rng"]
    for rank in (0, 1):
        # One call per gradient bucket and step at least.
        assert saved[rank]["comm_hook"]["calls"] >= 6, saved[rank]["comm_hook"]
        rows = [json.loads(ln) for ln in (job / "stats" / f"rank{rank}.jsonl").open()]
        assert rows[-1]["loss"] < rows[0]["loss"]


def test_a_user_sampler_policy_and_comm_hook_train_two_ranks_by_target(
    tmp_path: Path, caplog
) -> None:
    """In process, on two gloo ranks: the policy and hook named by `_target_` overrides."""
    record, job = tmp_path / "rows", tmp_path / "job"
    record.mkdir()
    summaries = train_ranks(
        job,
        *RUN,
        "~sampler",
        f"+sampler={{_target_:helpers.user_sampling.Backwards,drop_last:false,record_dir:'{record}'}}",
        "ddp.comm_hook={_target_:helpers.user_comm_hooks.CountingMean,note:mine}",
    )
    _check(job, record, summaries[0], summaries.logs[0])
    # Resumed mid-epoch (batch 1 of epoch 1) on one rank: the policy's recorded settings (the
    # documented {"_target_": ..., **arguments}) rebuild it, and the rows the rest of the epoch
    # reads twice or skips are counted, as for a built-in policy.
    with caplog.at_level(logging.INFO, logger="hydra_ddp.data.epoch_rows"):
        train_here(job, *RUN[:-2], "trainer.max_steps=7", "~sampler",
                   f"+sampler={{_target_:helpers.user_sampling.Backwards,drop_last:false,"
                   f"record_dir:'{record}'}}")  # fmt: skip
    (said,) = [r.message for r in caplog.records if "is read in another order" in r.message]
    assert (
        "on 2 rank(s)" in said and "1 rank(s) and sampler=helpers.user_sampling.Backwards" in said
    )
    assert re.search(r"(\d+ rows of the epoch are read twice and \d+ skipped|exact)$", said), said


@pytest.mark.slow  # a real self-launch (~15 s); the test above checks the same in process
def test_a_user_sampler_policy_and_comm_hook_train_two_ranks_by_yaml_alone(
    tmp_path: Path,
) -> None:
    """One real launch holds both, each one module and one YAML in the user's own folders."""
    code_dir, conf = tmp_path / "mine", tmp_path / "my_conf"
    code_dir.mkdir()
    (code_dir / "my_sampling.py").write_text((HELPERS / "user_sampling.py").read_text())
    (code_dir / "my_hooks.py").write_text((HELPERS / "user_comm_hooks.py").read_text())
    yamls = {
        "sampler/backwards.yaml": "_target_: my_sampling.Backwards\ndrop_last: false\n"
        "record_dir: ???\n",
        "ddp/counting.yaml": "comm_hook:\n  _target_: my_hooks.CountingMean\n  note: mine\n",
    }
    for name, text in yamls.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text)
    env = user_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(code_dir), env["PYTHONPATH"]])
    record = tmp_path / "rows"
    record.mkdir()
    ok(
        python_train(
            tmp_path,
            "--config-dir",
            str(conf),
            "dist.nproc_per_node=2",
            *RUN,
            "sampler=backwards",
            f"sampler.record_dir={record}",
            "ddp=counting",
            env=env,
            timeout=240,
        )  # fmt: skip
    )
    job = only_job_dir(tmp_path)
    _check(job, record, summary(job), (job / "train_rank0.log").read_text())
