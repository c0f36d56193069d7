"""Several ranks in process: `run(fn, ...)` calls `fn(env, ...)` on N ranks and returns what
each rank returned.

The ranks are worker processes started once per world size with torch.multiprocessing's spawn
start method and kept for the session, so a test pays no interpreter start-up. For each call
every worker gets a fresh, real gloo process group (a FileStore in a scratch dir; `group=False`
leaves the group to `fn`, e.g. `train`, which starts it from MASTER_ADDR/MASTER_PORT as under
torchrun) and a `DistEnv(rank=r, world_size=n, launched=True)`. An exception raised on a rank is
raised in the test (the lowest rank's that is not a peer's "connection closed" after it, with
that rank's traceback, output and log as notes); a rank that dies or a call that does not finish
within `timeout` fails the test (RankFailed), and the workers are replaced for the next call.
`fresh=True` runs a call on workers of its own, for what only a fresh interpreter can show.

Each call runs in an isolated state (`inproc.isolated`): environment variables, RNG, torch's
determinism flags, logging handlers and signal handlers are put back afterwards, and W&B's
service is torn down, so one call cannot change the next. What a rank logged (INFO and up, the
rank's own log file) and printed (its stdout and stderr) comes back in `Results.logs` and
`Results.outputs`.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")
# What torchrun does too: N ranks each running a full OpenMP pool on 2 cores fight over them.
# A fixed hash seed unlike the test process's random one: results that must not depend on
# Python's str hashing are compared across processes that hash differently.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "12345", "PYTHONUNBUFFERED": "1"}
# The launcher variables a test process may have inherited (CI under a launcher): not ours.
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SCRUB_PREFIXES = ("WANDB_", "TORCHELASTIC_", "SLURM_", "SUBMITIT_")
_LOG_FORMAT = "[%(name)s][%(levelname)s] - %(message)s"


class RankFailed(Exception):
    """A rank died, or the ranks did not finish in time."""

    def __init__(self, message: str, outputs: list[str], logs: list[str]):
        super().__init__(message)
        self.outputs, self.logs = outputs, logs


class RemoteError(Exception):
    """A rank's exception that could not be sent back as itself (not picklable)."""


class Results(list):
    """Each rank's return value (or exception, with return_exceptions=True), by rank."""

    logs: list[str]
    outputs: list[str]


@dataclass
class _Task:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    scratch: str
    group: bool
    port: int
    timeout_s: float
    env: dict[str, Optional[str]] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# The worker side
# --------------------------------------------------------------------------------------------


def _worker(rank: int, world_size: int, inbox: Any, outbox: Any) -> None:
    import torch

    torch.set_num_threads(1)
    import hydra_ddp.train  # noqa: F401  (warm: every task needs it, none should pay for it)

    while True:
        task = inbox.get()
        if task is None:
            return
        outbox.put((task.scratch, rank, *_run_task(rank, world_size, task)))


def _run_task(rank: int, world_size: int, task: _Task) -> tuple[str, Any, str]:
    import torch.distributed as dist

    from helpers.inproc import isolated
    from hydra_ddp.distributed import DistEnv

    scratch = Path(task.scratch)
    launcher = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(task.port),
    }
    with isolated(), _captured(scratch, rank):
        for key, value in {**launcher, **task.env}.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        env = DistEnv(
            rank=rank,
            local_rank=rank,
            world_size=world_size,
            launched=True,
        )
        try:
            try:
                if task.group:
                    store = dist.FileStore(str(scratch / "store"), world_size)
                    dist.init_process_group(
                        "gloo",
                        store=store,
                        rank=rank,
                        world_size=world_size,
                        timeout=datetime.timedelta(seconds=task.timeout_s),
                    )
                value = task.fn(env, *task.args, **task.kwargs)
            except BaseException as e:  # noqa: B036  (a rank's SystemExit goes to the test too)
                return "error", _picklable(e), traceback.format_exc()
            try:
                if task.group:
                    dist.barrier()  # no rank tears the group down under a peer's last collective
            except RuntimeError:
                pass  # a peer failed: its error is the one reported
            try:
                return "ok", _picklable(value), ""
            except Exception as e:
                return "error", RemoteError(f"the return value: {e}"), traceback.format_exc()
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            if "wandb" in sys.modules:  # its service and settings are per process: start afresh
                sys.modules["wandb"].teardown()


def _picklable(obj: Any) -> Any:
    try:
        return pickle.loads(pickle.dumps(obj))
    except Exception:
        if isinstance(obj, BaseException):
            return RemoteError(f"{type(obj).__module__}.{type(obj).__name__}: {obj}")
        raise


class _captured:
    """The rank's stdout/stderr (fds 1 and 2) into <scratch>/rank<r>.out and its log records
    (root logger, INFO) into <scratch>/rank<r>.log, for the duration of a task."""

    def __init__(self, scratch: Path, rank: int):
        self.out, self.log = scratch / f"rank{rank}.out", scratch / f"rank{rank}.log"

    def __enter__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        fd = os.open(self.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        root = logging.getLogger()
        root.setLevel(logging.INFO)
        # A FileHandler: Console.quiet_other_ranks raises only the console handlers' levels.
        self.handler = logging.FileHandler(self.log)
        self.handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        root.addHandler(self.handler)
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(_LOG_FORMAT))
        root.addHandler(console)

    def __exit__(self, *exc: object) -> None:
        self.handler.close()
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)


# --------------------------------------------------------------------------------------------
# The test side
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.outbox = _CTX.Queue()
        self.inboxes = [_CTX.Queue() for _ in range(world_size)]
        saved = dict(os.environ)
        try:
            for key in list(os.environ):
                if key in _SCRUB or key.startswith(_SCRUB_PREFIXES):
                    del os.environ[key]
            os.environ.update(_WORKER_ENV)
            self.procs = [
                _CTX.Process(
                    target=_worker,
                    args=(r, world_size, self.inboxes[r], self.outbox),
                    # Not daemonic: a rank may start DataLoader workers (trainer.num_workers).
                    # shutdown() (the end of the session) stops them.
                    daemon=False,
                    name=f"rank{r}",
                )
                for r in range(world_size)
            ]
            for p in self.procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for p, inbox in zip(self.procs, self.inboxes):
            if kill:
                p.kill()
            elif p.is_alive():
                inbox.put(None)
        deadline = time.monotonic() + 0.5  # a worker needs no graceful end
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.01))
            if p.is_alive():  # nothing of value left in it
                p.kill()
                p.join(timeout=10)

    def run(self, task: _Task, timeout: float, grace: float) -> dict[int, tuple[str, Any, str]]:
        """Each rank's (status, value, traceback). Raises RankFailed (and kills the workers)
        when a rank dies or the ranks do not all answer in time."""
        try:
            return self._run(task, timeout, grace)
        except BaseException:
            # Also when the test itself is stopped (pytest-timeout, Ctrl-C): workers still busy
            # with this call must not answer the next one.
            self.close(kill=True)
            raise

    def _run(self, task: _Task, timeout: float, grace: float) -> dict[int, tuple[str, Any, str]]:
        for inbox in self.inboxes:
            inbox.put(task)
        done: dict[int, tuple[str, Any, str]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            try:
                scratch, rank, status, value, tb = self.outbox.get(timeout=0.1)
                if scratch != task.scratch:
                    continue  # an answer to an earlier call (cannot happen: see run)
                done[rank] = (status, value, tb)
                if status == "error":  # a peer may now wait forever in a collective
                    deadline = min(deadline, time.monotonic() + grace)
                continue
            except queue.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead and not _drained(self.outbox, task, done):
                raise _failed(task, f"rank(s) died: {dead} (rank, exit code)", self.world_size)
            if time.monotonic() > deadline:
                if any(s == "error" for s, _, _ in done.values()):
                    self.close(kill=True)
                    return done  # the error is the story; the others hung on it
                raise _failed(task, f"timed out after {timeout:.0f} s (a hang?)", self.world_size)
        return done


def _drained(outbox: Any, task: _Task, done: dict) -> bool:
    """A last look at the queue (a rank may have answered just before exiting)."""
    try:
        scratch, rank, status, value, tb = outbox.get(timeout=0.5)
    except queue.Empty:
        return False
    if scratch == task.scratch:
        done[rank] = (status, value, tb)
    return True


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _failed(task: _Task, why: str, world_size: int) -> RankFailed:
    outputs, logs = _texts(Path(task.scratch), world_size)
    tail = "".join(
        f"\n--- rank {r}\n{out[-3000:]}{log[-3000:]}"
        for r, (out, log) in enumerate(zip(outputs, logs))
    )
    return RankFailed(f"{task.fn.__qualname__}: {why}{tail}", outputs, logs)


def _texts(scratch: Path, world_size: int) -> tuple[list[str], list[str]]:
    outputs = [_read(scratch / f"rank{r}.out") for r in range(world_size)]
    logs = [_read(scratch / f"rank{r}.log") for r in range(world_size)]
    return outputs, logs


_pools: dict[int, _Pool] = {}


def run(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    group: bool = True,
    env: Optional[dict[str, Optional[str]]] = None,
    return_exceptions: bool = False,
    fresh: bool = False,
    grace: float = 15.0,
    **kwargs: Any,
) -> Results:
    """`fn(env, *args, **kwargs)` on `world_size` ranks; each rank's return value, by rank.

    fn: a top-level (picklable) function; env: its rank's DistEnv. group: start a gloo process
    group around the call (False: fn starts one itself, from MASTER_ADDR/MASTER_PORT, RANK and
    WORLD_SIZE, as `train` does). env: environment variables for the call (None unsets).
    return_exceptions: a rank's exception is its result instead of being raised. fresh: new
    worker processes for this call only (a check of what a fresh interpreter imports).
    """
    pool = None if fresh else _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _Pool(world_size)
        if not fresh:
            _pools[world_size] = pool
    scratch = Path(tempfile.mkdtemp(prefix="ranks-"))
    task = _Task(fn, args, kwargs, str(scratch), group, free_port(), timeout, dict(env or {}))
    try:
        done = pool.run(task, timeout, grace)
        outputs, logs = _texts(scratch, world_size)
    finally:
        if fresh:
            pool.close()
        shutil.rmtree(scratch, ignore_errors=True)
    results = Results()
    results.logs, results.outputs = logs, outputs
    raised, hung = [], []
    for rank in range(world_size):
        if rank not in done:  # it waited on a peer that had failed, and was stopped
            hung.append(rank)
            results.append(RankFailed(f"rank {rank} hung after a peer failed", outputs, logs))
            continue
        status, value, tb = done[rank]
        if status == "error":
            value.add_note(f"--- raised on rank {rank} of {world_size}:\n{tb}")
            value.add_note(f"--- rank {rank}'s output:\n{outputs[rank][-4000:]}")
            value.add_note(f"--- rank {rank}'s log:\n{logs[rank][-4000:]}")
            raised.append(value)
        results.append(value)
    if raised and (not return_exceptions or hung):
        # The cause, rather than a peer's "connection closed" after the failed rank left.
        raise next((e for e in raised if not _lost_peer(e)), raised[0])
    return results


def _lost_peer(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in ("closed by peer", "reset by peer", "Broken pipe"))


def shutdown() -> None:
    """Stop every worker (the end of the session)."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()
