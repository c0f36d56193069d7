"""What the ranks must agree on, on 2 real gloo ranks in process (helpers/ranks.py): exact
distributed evaluation, the stop on a signal, the monitor's early-stop decision. And the helper
itself: a rank's exception reaches the test, a hang fails it within the timeout.

(Also on real ranks elsewhere: the sampler's partition in test_sampling.py, DDP equal to one
process with the global batch in test_train.py.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from helpers import ranks

from hydra_ddp.config import MonitorMode, TrainerConfig
from hydra_ddp.distributed import DistEnv
from hydra_ddp.distributed.preemption import StopOnSignal
from hydra_ddp.errors import UserError
from hydra_ddp.launcher_env import STOP_SIGNALS
from hydra_ddp.loop.evaluation import Monitor
from hydra_ddp.loop.scoring import evaluate
from hydra_ddp.metrics import Accuracy, MeanSquaredError

# --------------------------------------------------------------------------------------------
# The helper
# --------------------------------------------------------------------------------------------


def _sum_of_ranks(env: DistEnv, extra: int) -> tuple[int, int]:
    t = torch.tensor([env.rank + extra])
    dist.all_reduce(t)
    print(f"rank {env.rank} of {env.world_size} printed")
    return env.rank, int(t)


def _rank1_raises(env: DistEnv) -> int:
    if env.rank == 1:
        raise UserError("rank 1 was told so")
    dist.barrier()  # rank 0 waits on rank 1, which is gone: its error is the one reported
    return env.rank


def _hang(env: DistEnv) -> None:
    time.sleep(600)


def test_ranks_run_a_function_on_every_rank_over_gloo() -> None:
    done = ranks.run(_sum_of_ranks, 10)
    assert list(done) == [(0, 21), (1, 21)]
    assert [f"rank {r} of 2 printed" in out for r, out in enumerate(done.outputs)] == [True] * 2


def test_a_ranks_exception_is_raised_in_the_test() -> None:
    with pytest.raises(UserError, match="rank 1 was told so") as info:
        ranks.run(_rank1_raises)
    assert any("raised on rank 1 of 2" in note for note in info.value.__notes__)


@pytest.mark.slow  # a real launch; the default suite keeps to 5 minutes
def test_a_hang_fails_within_the_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(ranks.RankFailed, match="timed out after 2 s"):
        ranks.run(_hang, world_size=1, timeout=2)
    assert time.monotonic() - t0 < 30
    assert ranks.run(_sum_of_ranks, 1, world_size=1) == [(0, 1)]  # fresh workers after it


# --------------------------------------------------------------------------------------------
# Exact distributed evaluation
# --------------------------------------------------------------------------------------------


def _split(rows: list[int], rank: int, task: str):
    """The same 32 rows everywhere; rank r takes rows[r] of them, in batches of 5 (a share
    starts at a multiple of 5: the batches are those of one process over all rows)."""
    torch.manual_seed(0)
    out = 3 if task == "classify" else 1
    model = torch.nn.Linear(8, out)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(rows), 8, generator=g)
    y = torch.randint(0, 3, (sum(rows),), generator=g) if out == 3 else torch.randn(sum(rows), 1)
    start = sum(rows[:rank])
    x, y = x[start : start + rows[rank]], y[start : start + rows[rank]]
    batches = [(x[i : i + 5], y[i : i + 5]) for i in range(0, len(x), 5)]
    if task == "classify":
        return model, batches, torch.nn.CrossEntropyLoss(), {"acc": Accuracy()}
    return model, batches, torch.nn.MSELoss(), {"mse": MeanSquaredError()}


def _evaluate_share(env: DistEnv, rows: list[int], task: str) -> dict[str, float]:
    model, batches, loss_fn, metrics = _split(rows, env.rank, task)
    return evaluate(model, batches, env, loss_fn, metrics, contextlib.nullcontext())


@pytest.mark.parametrize("task", ["classify", "regress"])
@pytest.mark.parametrize("rows", [[20, 12], [32, 0]], ids=["uneven", "one_rank_empty"])
def test_evaluation_over_ranks_equals_one_process(rows: list[int], task: str) -> None:
    """Every row counted once, weighted by its batch: the ranks' sums give exactly the loss and
    metrics of one process over all rows (the same batches), even when a rank holds no row."""
    done = ranks.run(_evaluate_share, rows, task)
    assert done[0] == done[1]  # one answer on every rank
    model, batches, loss_fn, metrics = _split([sum(rows)], 0, task)
    alone = evaluate(model, batches, DistEnv(), loss_fn, metrics, contextlib.nullcontext())
    assert done[0] == pytest.approx(alone, rel=1e-12)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert alone["loss"] == pytest.approx(loss_fn(model(x), y).item(), rel=1e-6)


# --------------------------------------------------------------------------------------------
# Stopping on a signal
# --------------------------------------------------------------------------------------------


def _steps_until_stop(env: DistEnv, signalled_rank: int, at_step: int) -> tuple[int, int]:
    """A loop of 2 ms steps; `signalled_rank` gets SIGUSR1 before step `at_step`. Where each
    rank stops, and on which signal."""
    stopper = StopOnSignal(env).start()
    try:
        for step in range(2000):
            if env.rank == signalled_rank and step == at_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            signum = stopper.agreed()
            if signum:
                return step, signum
            time.sleep(0.002)
        return -1, 0
    finally:
        stopper.restore()


def _slow_steps_until_stop(env: DistEnv, step_s: float) -> tuple[int, float]:
    """Steps of `step_s`; rank 1 gets SIGTERM in the middle of step 2. The step where each rank
    stops, and how long after the signal."""
    stopper = StopOnSignal(env).start()
    sent = 0.0
    try:
        for step in range(8):
            signum = stopper.agreed()
            if signum:
                return step, time.monotonic() - sent
            time.sleep(step_s / 2)
            if env.rank == 1 and step == 2:
                sent = time.monotonic()
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(step_s / 2)
        return -1, 0.0
    finally:
        stopper.restore()


def test_a_signal_in_a_slow_step_stops_at_the_end_of_that_step() -> None:
    """Previously: the ranks agreed through an all-reduce read one check later, so a signal
    in step N stopped the ranks after step N+1 or N+2: with 20 s steps past the 30 s torchrun's
    agent gives, and every rank was killed before its checkpoint."""
    done = ranks.run(_slow_steps_until_stop, 0.5)
    assert done[0][0] == done[1][0] == 3, done  # the boundary right after step 2
    assert done[1][1] < 0.5 + 0.4, done  # within the rest of the step, plus load


@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(signalled_rank: int) -> None:
    done = ranks.run(_steps_until_stop, signalled_rank, 30)
    (step, signum), other = done
    assert other == (step, signum) and signum == signal.SIGUSR1
    assert 30 <= step < 30 + 200  # within about the check interval (0.1 s of steps)


# --------------------------------------------------------------------------------------------
# The monitor's early stop
# --------------------------------------------------------------------------------------------


def _monitor_decisions(env: DistEnv, values: list[list[float]]) -> list[tuple[bool, bool]]:
    tcfg = TrainerConfig(
        monitor="val/acc",
        monitor_mode=MonitorMode.max,
        eval_interval=5,
        early_stop_patience=2,
    )
    monitor = Monitor(tcfg, "acc")
    decisions = []
    for i, value in enumerate(values[env.rank], 1):
        improved = monitor.update(5 * i, {"acc": value}, env)
        decisions.append((improved, monitor.should_stop))
    return decisions


def test_monitor_ranks_take_rank0s_decision() -> None:
    """Rank 1 sees (made-up) values that keep improving, rank 0 values that stop improving:
    both ranks take rank 0's decision at every evaluation, so they stop together."""
    rank0 = [0.5, 0.6, 0.6, 0.55]
    rank1 = [0.5, 0.7, 0.8, 0.9]
    done = ranks.run(_monitor_decisions, [rank0, rank1])
    want = [(True, False), (True, False), (False, False), (False, True)]
    assert done[0] == done[1] == want


def test_under_torchrun_the_agents_closing_signal_after_the_checkpoint_kills_no_rank(
    monkeypatch,
) -> None:
    """A stopped rank whose peers exit first gets SIGTERM from torch's agent closing the job,
    seconds after the signal it stopped on. Once its checkpoint is written that is no second
    request to stop at once (which killed it, exit -15, so torchrun failed the job): it is
    ignored until the rank exits. Before the checkpoint a repeat still stops at once."""
    from hydra_ddp.distributed import preemption

    monkeypatch.setattr(preemption, "_REPEAT_WINDOW_S", 0.0)  # every repeat is a second request
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    forced: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in STOP_SIGNALS)}
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: forced.append(signum))
        stopper = StopOnSignal(DistEnv()).start()
        signal.raise_signal(signal.SIGTERM)
        assert stopper.agreed() == signal.SIGTERM
        stopper.saved()
        time.sleep(0.01)
        signal.raise_signal(signal.SIGTERM)  # the agent closing the job
        assert forced == [] and stopper.signals == [signal.SIGTERM]
        stopper.restore()  # the loop is left; the process exits with 128 + SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN

        signal.signal(signal.SIGTERM, lambda signum, frame: forced.append(signum))
        stopper = StopOnSignal(DistEnv()).start()
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.01)
        signal.raise_signal(signal.SIGTERM)  # a second request before the checkpoint
        assert forced == [signal.SIGTERM]
    finally:
        # restore() left every stop signal ignored, as a worker on its way out wants; this
        # process (pytest) goes on, and its later child processes would inherit "ignore".
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_every_signal_is_remembered_and_each_earlier_handler_runs_after_the_checkpoint() -> None:
    """A site's SIGTERM, then submitit's SIGUSR2: the stop happens on the first, and both
    earlier handlers run after the checkpoint (submitit requeues on its USR2 even when TERM came
    first). A different second signal is not "asked twice": it does not stop at once."""
    import signal

    from hydra_ddp.distributed import DistEnv

    called: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        for sig in saved:
            signal.signal(sig, lambda signum, frame: called.append(signum))
        stopper = StopOnSignal(DistEnv()).start()
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGUSR2)
        assert stopper.agreed() == signal.SIGTERM
        assert stopper.signals == [signal.SIGTERM, signal.SIGUSR2]
        assert called == []  # nothing ran yet: the checkpoint comes first
        stopper.chain()
        assert called == [signal.SIGTERM, signal.SIGUSR2]
        stopper.restore()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
