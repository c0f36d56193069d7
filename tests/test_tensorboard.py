"""logger=tensorboard on 2 real gloo ranks, read back with TensorBoard's own EventAccumulator;
with it what every sink shares: stat names (a text run's total tokens/s), the learning rate of
every parameter group, and the rule of ctx.log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAST
from helpers.inproc import train_here, train_ranks
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hydra_ddp.errors import UserError
from hydra_ddp.tracking.sink import loggable_values, plain

TEXT = [
    "data=text", "model=gpt", "model.n_layer=1", "model.n_embd=16", "model.n_head=2",
    "data.block_size=16", "trainer.batch_size=8", "trainer.limit_eval_batches=2",
]  # fmt: skip
STEPS, EVERY = 6, 2


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _events(folder: Path) -> EventAccumulator:
    # size_guidance 0: keep every event (the default samples scalars down past 10 000).
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tensorboard") / "job"
    train_ranks(
        out, *TEXT, "logger=tensorboard", "trainer.progress=false",
        f"trainer.max_steps={STEPS}", f"trainer.log_interval={EVERY}",
        "+optim.param_groups=[{params: 'pos.*', lr: 0.01}]",
        "+callbacks.log._target_=helpers.user_log_callbacks.LogEveryRank",
    )  # fmt: skip
    return out


def test_tensorboard_has_every_ranks_loss_at_every_log_interval(text_run: Path) -> None:
    logged = list(range(EVERY, STEPS + 1, EVERY))
    for rank in (0, 1):
        acc = _events(text_run / "tensorboard" / f"rank{rank}")
        rows = _jsonl(text_run / "stats" / f"rank{rank}.jsonl")
        stats = {r["step"]: r for r in rows if "loss" in r}
        loss = acc.Scalars("train/loss")
        assert [e.step for e in loss] == logged
        assert [e.value for e in loss] == pytest.approx([stats[s]["loss"] for s in logged])
        assert [e.step for e in acc.Scalars("train/tokens_per_s")] == logged
        # ctx.log's scalars (a number, a one-element tensor) at every step; its text as text.
        mine = acc.Scalars("train/rank_step")
        assert [(e.step, e.value) for e in mine] == [(s, 100 * rank + s) for s in range(1, 7)]
        assert {e.value for e in acc.Scalars("train/half")} == {0.5}
        assert "train/note/text_summary" in acc.Tags()["tensors"]
        # Every group's learning rate: param_groups[0] ('pos.*') and the rest.
        head, rest = acc.Scalars("train/lr/default/0"), acc.Scalars("train/lr/default/rest")
        for e, r in zip(head, rest):  # the schedule scales both: 0.01 vs optim.lr (0.002)
            assert e.value / r.value == pytest.approx(0.01 / 0.002, rel=1e-5)
            assert e.value == pytest.approx(stats[e.step]["lr/default/0"], rel=1e-6)
        tags = acc.Tags()["scalars"]
        assert any(t.startswith("agg/") for t in tags) == (rank == 0)  # rank 0's aggregates
        assert ("val/loss" in tags) == (rank == 0)


def test_a_text_runs_aggregate_has_its_total_tokens_per_s(text_run: Path) -> None:
    ranks = [
        {r["step"]: r for r in _jsonl(text_run / "stats" / f"rank{k}.jsonl") if "loss" in r}
        for k in (0, 1)
    ]
    agg = _jsonl(text_run / "stats" / "aggregate.jsonl")
    assert [a["step"] for a in agg] == list(range(EVERY, STEPS + 1, EVERY))
    for row in agg:
        total = sum(r[row["step"]]["tokens_per_s"] for r in ranks)
        assert row["tokens_per_s_total"] == pytest.approx(total)
        assert "samples_per_s_total" not in row
    acc = _events(text_run / "tensorboard" / "rank0")
    assert len(acc.Scalars("agg/tokens_per_s_total")) == len(agg)


def test_stats_files_have_every_groups_lr_and_ctx_log_rows(text_run: Path) -> None:
    for rank in (0, 1):
        rows = _jsonl(text_run / "stats" / f"rank{rank}.jsonl")
        stats = [r for r in rows if "loss" in r]
        assert all({"lr/default/0", "lr/default/rest"} <= r.keys() for r in stats)
        assert not any("lr" in r for r in stats)  # several groups: no single `lr`
        logged = [r for r in rows if "rank_step" in r]
        assert [(r["step"], r["rank_step"]) for r in logged] == [
            (s, 100 * rank + s) for s in range(1, 7)
        ]
        assert all(r["half"] == 0.5 and r["note"].startswith(f"rank {rank}") for r in logged)


def test_ctx_log_rule() -> None:
    """One rule for every sink: scalars (a one-element tensor too) and text pass, W&B media pass
    (the stats file gets a placeholder), reserved keys and other values are refused."""
    import numpy as np
    import torch
    import wandb

    out = loggable_values(
        {"a": torch.tensor(2.5), "b": np.float64(1.5), "c": 3, "d": "text", "e": True}, []
    )
    assert out == {"a": 2.5, "b": 1.5, "c": 3, "d": "text", "e": True}
    histogram = wandb.Histogram([1.0, 2.0, 3.0])
    assert loggable_values({"h": histogram}, [])["h"] is histogram
    assert plain(histogram) == "<wandb.Histogram>"
    for key in ("step", "rank", "time", "loss", "lr", "lr/default/0", "step_time", "epoch"):
        with pytest.raises(ValueError, match=f"ctx.log key '{key}' is a field or stat"):
            loggable_values({key: 1.0}, [])
    with pytest.raises(ValueError, match="'loss_aux' is a field or stat"):
        loggable_values({"loss_aux": 1.0}, ["loss", "loss_aux"])  # a term this job logs
    for bad, what in (([1, 2], "list"), (torch.ones(3), "a tensor of 3 elements"), (None, "None")):
        with pytest.raises(ValueError, match=f"ctx.log value 'x' is {what}"):
            loggable_values({"x": bad}, [])


@pytest.mark.parametrize("key, value", [("loss", "1"), ("x", "tensor")])
def test_ctx_log_refusal_names_the_callback(tmp_path: Path, key: str, value: str) -> None:
    with pytest.raises(UserError) as caught:
        train_here(
            tmp_path / "job", *FAST, "trainer.max_steps=3",
            "+callbacks.bad._target_=helpers.user_log_callbacks.LogValue",
            f"+callbacks.bad.key={key}",
            f"+callbacks.bad.value={value}",
        )  # fmt: skip
    line = str(caught.value)
    assert "\n" not in line and line.startswith(
        "callbacks.bad (helpers.user_log_callbacks.LogValue)"
    )
    assert f"ctx.log {'key' if key == 'loss' else 'value'} '{key}'" in line, line


def test_a_sink_of_yours_is_chosen_by_target_and_gets_every_ranks_stats(tmp_path: Path) -> None:
    """A sink is a module of the user's and a `_target_` (here an override; a YAML in
    conf/logger/ does the same): on 2 real gloo ranks each rank's sink gets its own stats, and
    rank 0's the table of every rank's and the aggregates, the evaluations and the summary."""
    out = tmp_path / "job"
    train_ranks(
        out, "logger=none", "trainer.progress=false", "trainer.max_steps=4",
        "trainer.log_interval=2", "trainer.eval_interval=4",
        "logger.sink={_target_: helpers.user_sinks.Collect, label: mine}",
    )  # fmt: skip
    got = {r: json.loads((out / f"sink_rank{r}.json").read_text()) for r in (0, 1)}
    for rank, sink in got.items():
        assert sink["label"] == "mine" and sink["failed"] is False
        stats = [r for r in sink["records"] if r["kind"] == "stats"]
        assert [r["step"] for r in stats] == [2, 4] and {r["rank"] for r in stats} == {rank}
        assert "loss" in stats[0]["keys"] and "step_time" in stats[0]["keys"]
        intervals = [r for r in sink["records"] if r["kind"] == "interval"]
        assert [r["step"] for r in intervals] == [2, 4]
        assert all(r["table_ranks"] == [0, 1] for r in intervals)
        # Rank 0 alone computes the aggregates and gets the evaluations and the summary.
        assert all(bool(r["aggregates"]) == (rank == 0) for r in intervals)
        evals = [r for r in sink["records"] if r["kind"] == "eval"]
        assert bool(evals) == (rank == 0) and bool(sink["summaries"]) == (rank == 0)
    assert "val/loss" in [r for r in got[0]["records"] if r["kind"] == "eval"][0]["keys"]


@pytest.mark.parametrize(
    "target, says, advice",
    [
        ("helpers.user_sinks.Colect", "cannot be imported", "conf/logger/*.yaml"),
        ("helpers.user_sinks.NotASink", "lacks log, summary, add_config, close", "protocols.Sink"),
    ],
)
def test_a_bad_sink_target_is_one_line_when_the_config_is_typed(
    target: str, says: str, advice: str
) -> None:
    """Before any worker or process group: `to_typed` (train.py) fails in one line."""
    from helpers.inproc import typed

    with pytest.raises(UserError) as e:
        typed(f"logger.sink._target_={target}")
    line = str(e.value)
    assert line.startswith(f"logger.sink._target_='{target}' {says}") and "\n" not in line
    assert advice in line  # what to do: pick a logger, or meet the protocol
