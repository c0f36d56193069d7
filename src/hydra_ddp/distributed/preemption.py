"""Stopping on request: a preempted or interrupted job ends with a checkpoint, not a traceback.
The signal only sets a flag; at the next step boundary every rank learns whether any rank got
one, and all save one checkpoint together and stop with `Preempted` (exit status 128 + the
signal). docs/when_things_go_wrong.md ("Preemption and Ctrl-C") says what a user sees.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable

import torch
import torch.distributed as dist

from hydra_ddp.distributed import DistEnv
from hydra_ddp.errors import Stopped
from hydra_ddp.launcher_env import STOP_SIGNALS, torchrun_worker

log = logging.getLogger(__name__)

# A second request later than this after the first stops at once; the first Ctrl-C of a
# self-launched job reaches a worker twice (terminal and agent) within it: one request.
_REPEAT_WINDOW_S = 1.0
# Ranks check for a stop request about this often (in steps of rank 0's step time), at most
# every _MAX_INTERVAL steps: well inside the 30 s a launcher gives before it kills.
CHECK_EVERY_S = 0.1
_MAX_INTERVAL = 100


class Preempted(Stopped):
    """The job stopped on a signal after saving a checkpoint (or with nothing to save)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.logged = False  # the loop logs its own stop before submitit's handler may exit

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_exit_codes() -> set[int]:
    """The exit statuses of a worker that stopped on one of STOP_SIGNALS (128 + its number)."""
    return {128 + getattr(signal, n) for n in STOP_SIGNALS if hasattr(signal, n)}


def run_dir_override(output_dir: object, key: str = "hydra.run.dir") -> str:
    """`hydra.run.dir=<dir>` as it must be typed: quoted when the dir's name holds characters
    of Hydra's override grammar (a sweep job's `0_model=mlp,optim.lr=0.01`)."""
    text = str(output_dir)
    if any(c in text for c in "=,:'\"()[]{} "):
        return f"\"{key}='{text}'\""
    return f"{key}={text}"


def rerun(output_dir: object, sweep_dir: object | None) -> str:
    """How to run a stopped job again in its dir: a sweep's job through its sweep (under -m,
    Hydra ignores hydra.run.dir)."""
    if sweep_dir is not None:
        where = run_dir_override(sweep_dir, "hydra.sweep.dir")
        return f"re-run the sweep with {where} (each job continues in its own dir)"
    return f"re-run the same command with {run_dir_override(output_dir)}"


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def stop_message(signum: int, step: int, total_steps: int, run: Any) -> str:
    return (
        f"stopped on {signal_name(signum)} at step {step} of {total_steps} with a checkpoint: "
        f"{rerun(run.output_dir, run.sweep_dir)} to resume (a SLURM "
        "or submitit requeue does so by itself)"
    )


class StopOnSignal:
    """Catches the stop signals while the loop runs; `agreed()` at each step boundary says
    whether the ranks are to stop there.

    Ranks agree with a tiny blocking all-reduce, so a signal that reaches any rank during a step
    stops every rank at its end, however long the step: within the grace a launcher gives (an
    asynchronous agreement would stop long steps too late). Rank 0 sends in the same
    all-reduce how many steps to wait before the next check (about `CHECK_EVERY_S`), so a 2 ms
    step does not pay a collective each time. Under NCCL it runs on a gloo group of its own:
    reading a CUDA tensor would sync the GPU.
    """

    def __init__(self, env: DistEnv, timeout_s: float = 1800.0) -> None:
        self.env = env
        self.timeout_s = timeout_s  # dist.timeout_s, also for the gloo group of the check
        self.signals: list[int] = []  # every stop signal received, in order
        self._when = 0.0
        self._previous: dict[int, Any] = {}
        # [the signal some rank got, rank 0's steps until the next check]; reduced with MAX.
        self._flag = torch.zeros(2, dtype=torch.int64)
        self._group: Any = None
        self._countdown = 0  # boundaries left before the next check
        self._last_check = time.monotonic()
        self._boundaries = 0  # boundaries since the last check
        self._checked = False
        self._saved = False  # the stop's checkpoint is written, under torch's agent

    def start(self) -> StopOnSignal:
        self._last_check = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._on_signal)
        if self.env.distributed and dist.get_backend() != "gloo":
            self._group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
            )
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._saved:
            return
        now = time.monotonic()
        if signum in self.signals and now - self._when > _REPEAT_WINDOW_S:
            # The same request twice: give the signal back its earlier meaning and deliver it
            # again. (Another signal is no repeat: its handler runs after the checkpoint.)
            self.restore()
            signal.raise_signal(signum)
            return
        if not self.signals:
            self._when = now
        if signum not in self.signals:
            self.signals.append(signum)

    @property
    def received(self) -> int:
        """The first stop signal received (0: none)."""
        return self.signals[0] if self.signals else 0

    def agreed(self) -> int:
        """The signal (its number) that some rank got before this boundary, the same on every
        rank; 0 to go on. `# collective` at the boundaries rank 0 chose."""
        if not self.env.distributed:
            return self.received
        self._boundaries += 1
        if self._countdown > 0:
            self._countdown -= 1
            return 0
        now = time.monotonic()
        step_s = (now - self._last_check) / self._boundaries
        self._last_check, self._boundaries = now, 0
        # The first boundary follows no step: its "step time" says nothing.
        proposal = 1
        if self._checked:
            proposal = min(max(int(CHECK_EVERY_S / max(step_s, 1e-6)), 1), _MAX_INTERVAL)
        self._checked = True
        self._flag[0] = self.received
        self._flag[1] = proposal if self.env.is_main else 0
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)  # collective
        agreed, interval = (int(v) for v in self._flag.tolist())
        self._countdown = interval - 1
        return agreed

    def saved(self) -> None:
        """The stop's checkpoint is written. Under torch's agent, a rank whose peers exit first
        gets SIGTERM from the agent closing the job: no second request to stop at once, which
        would kill it before its W&B run is closed and turn the job's exit status into a failure.
        Until it exits it ignores the stop signals (the agent kills it should its exit hang)."""
        self._saved = torchrun_worker()

    def chain(self) -> None:
        """After the checkpoint: run the earlier Python handler of every signal received, in
        order, e.g. submitit's, which requeues the SLURM job."""
        for signum in self.signals:
            previous = self._previous.get(signum)
            if callable(previous) and previous is not signal.default_int_handler:
                previous(signum, None)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            if self._saved:  # this worker is on its way out (saved())
                handler = signal.SIG_IGN
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}


def data_worker_init(worker_id: int) -> None:
    """A DataLoader worker's `worker_init_fn`: deaf to the stop signals, which its rank handles.
    A signal to the whole job (a SLURM time limit, `scancel`) would otherwise kill the workers
    and fail the rank before its checkpoint (SIGINT the worker loop already takes quietly)."""
    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and sig != signal.SIGINT:
            signal.signal(sig, signal.SIG_IGN)


def exit_with_parent() -> None:
    """Under torch's elastic agent (torchrun): a worker whose agent dies gets SIGTERM, so it
    stops like a preempted job (checkpoint, exit) instead of training on unsupervised."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    pr_set_pdeathsig = 1
    libc: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    if libc(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("could not ask to be stopped when the agent dies (prctl failed)")
        return
    if os.getppid() == 1:  # the agent died before we asked
        os.kill(os.getpid(), signal.SIGTERM)
