"""When a schedule steps (scheduler.interval, scheduler.monitor; optim.Optimizers): after each
optimizer step (the default), at each epoch's end, or after each validation with a metric, as
ReduceLROnPlateau wants, through the real loop in process; and the one-line errors for an
unknown interval or a monitor that names no metric. The epoch-stepped schedule on two ranks is
in test_hooks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST
from helpers.inproc import train_here

from hydra_ddp.errors import UserError
from hydra_ddp.optim import Optimizers

SGD = {"_target_": "torch.optim.SGD", "lr": 1.0}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_monitored_schedule_steps_after_each_validation_with_its_metric(tmp_path: Path) -> None:
    # mode=max on the loss with patience 0: every validation that does not raise the loss
    # halves the learning rate, so the run shows several changes.
    train_here(
        tmp_path, *FAST, "scheduler=plateau", "scheduler.mode=max", "scheduler.patience=0",
        "trainer.max_steps=8", "trainer.eval_interval=2", "trainer.log_interval=1",
    )  # fmt: skip
    lrs = {r["step"]: r["lr"] for r in _jsonl(tmp_path / "stats" / "rank0.jsonl") if "lr" in r}
    evals = {r["step"]: r["val/loss"] for r in _jsonl(tmp_path / "stats" / "eval.jsonl")}
    # The same schedule, replayed with the logged validation losses of steps 2, 4, 6.
    replay = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lrs[1])
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(replay, "max", 0.5, 0)
    expected = {}
    for step in range(1, 9):
        expected[step] = replay.param_groups[0]["lr"]
        if step in (2, 4, 6):  # the validation after step 8 comes after the last step
            plateau.step(evals[step])
    assert lrs == pytest.approx(expected, rel=1e-9)
    assert len(set(lrs.values())) >= 2  # it did change the learning rate


def test_an_epoch_stepped_schedule_of_the_template_spans_the_runs_epochs() -> None:
    model = torch.nn.Linear(2, 2)
    cosine = {"_target_": "hydra_ddp.optim.warmup_cosine", "interval": "epoch",
              "warmup_steps": 0, "min_lr_ratio": 0.1}  # fmt: skip
    opts = Optimizers.build(SGD, cosine, model, total_steps=30, total_epochs=3)
    optimizer = opts.optimizers["default"]
    optimizer.step()  # as in the loop: the optimizer steps before its schedule
    lr = lambda: optimizer.param_groups[0]["lr"]  # noqa: E731
    for _ in range(10):
        opts.step_schedules()  # steps do not move it
    assert lr() == pytest.approx(1.0)
    for _ in range(3):
        opts.end_epoch()
    assert lr() == pytest.approx(0.1)  # the cosine's end after the third epoch


@pytest.mark.parametrize(
    ("scheduler", "message"),
    [
        ({"interval": "epochs"}, r"scheduler\.interval='epochs' is not one of step, epoch"),
        ({"monitor": "val/acc"}, r"scheduler\.monitor=val/acc is not a validation metric"),
        ({"monitor": "loss"}, r"scheduler\.monitor=loss is not a validation metric"),
        ({"monitor": "val/loss", "interval": "epoch"}, r"scheduler: give interval or monitor"),
    ],
)
def test_a_wrong_interval_or_monitor_is_one_line_naming_the_key(scheduler, message) -> None:
    plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", **scheduler}
    with pytest.raises(UserError, match=message):
        Optimizers.build(SGD, plateau, torch.nn.Linear(2, 2), 10, 1, ["loss"])


def test_a_monitor_naming_no_metric_stops_the_job_before_training(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"scheduler\.monitor=val/f1 is not a validation metric "
                       r"of this job: use one of val/loss, val/acc"):  # fmt: skip
        train_here(tmp_path, *FAST, "scheduler=plateau", "scheduler.monitor=val/f1")
    assert not (tmp_path / "stats").exists() and not (tmp_path / "checkpoints").exists()


def test_an_epoch_stepped_schedule_resumed_mid_epoch_steps_at_the_same_boundaries(
    tmp_path: Path,
) -> None:
    # 2 steps per epoch; stopped at step 3 (mid-epoch 1), resumed to step 6.
    common = [*FAST, "scheduler=epoch_step", "trainer.limit_train_batches=2",
              "trainer.log_interval=1", "trainer.ckpt_interval=3"]  # fmt: skip
    train_here(tmp_path, *common, "trainer.max_steps=3")
    train_here(tmp_path, *common, "trainer.max_steps=6")
    lrs = {r["step"]: r["lr"] for r in _jsonl(tmp_path / "stats" / "rank0.jsonl") if "lr" in r}
    assert sorted(lrs) == list(range(1, 7))
    assert lrs == pytest.approx({s: lrs[1] * 0.5 ** ((s - 1) // 2) for s in range(1, 7)})


def test_each_optimizer_steps_its_own_schedule_by_its_own_interval() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    halve = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 1, "gamma": 0.5}
    optim = {
        "first": {**SGD, "params": "0.*"},  # the shared `scheduler`: by step
        "second": {**SGD, "params": "1.*", "scheduler": {**halve, "interval": "epoch"}},
    }
    opts = Optimizers.build(optim, halve, model, total_steps=10, total_epochs=2)
    for optimizer in opts.optimizers.values():
        optimizer.step()
    opts.step_schedules()
    opts.step_schedules()
    opts.end_epoch()
    assert opts.learning_rates() == {"lr/first/rest": 0.25, "lr/second/rest": 0.5}
