"""Ctrl-C while a launched worker starts: a clean exit 130, not a traceback from every worker.

A worker that torchrun or the self-launch (launch/workers.py) starts spends seconds importing
torch and building its job before the loop's signal handlers (distributed/preemption.py) take over.
The terminal sends Ctrl-C to every process of the job, so each worker would die in that time
with a KeyboardInterrupt traceback (often inside `import torch`), burying the launcher's own
line. Importing this module (train.py does it first, before torch) makes a KeyboardInterrupt
that ends a launched process exit 130 silently: the launcher says the one line (workers.py for
a self-launched job, runner.py's rank 0 under torchrun).

The self-launch closes the remaining gap, the interpreter's own start-up before this import:
its agent starts the workers with SIGINT blocked (`held_for_workers`), and a worker unblocks it
here, once the quiet exit is in place; a Ctrl-C in between waits, pending, and lands here.

Standard library only: it must be importable before torch is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import TracebackType
from typing import Iterator

from hydra_ddp.launcher_env import SIGINT_HELD_ENV, torchrun_worker

EXIT_CODE = 128 + signal.SIGINT

_previous_hook = sys.excepthook
_MASKS = hasattr(signal, "pthread_sigmask")  # POSIX
# The stop signals the agent handles besides INT and TERM (distributed.torchrun.AGENT_SIGNALS).
_TRACKER_SPARED = ("SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def launched() -> bool:
    """This process is a worker of torchrun or of the self-launch (or a child of one)."""
    if torchrun_worker() or SIGINT_HELD_ENV in os.environ:
        return True
    import multiprocessing

    return multiprocessing.parent_process() is not None


def ignore_more() -> None:
    """After the first Ctrl-C: the same one comes again (from the terminal and forwarded by the
    agent), and must not interrupt the exit with a second traceback."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _quiet_exit(kind: type[BaseException], value: BaseException, tb: TracebackType | None):
    if not issubclass(kind, KeyboardInterrupt):
        return _previous_hook(kind, value, tb)
    ignore_more()
    # Under torchrun nobody else says it (its agent prints only its own traceback); under the
    # self-launch the launching process does.
    if os.environ.get("RANK") == "0" and torchrun_worker():
        sys.stderr.write("stopped on SIGINT while starting, before any step was trained\n")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_CODE)


def quiet_while_starting() -> None:
    """In a launched worker: an uncaught KeyboardInterrupt exits 130 without a traceback, and
    a SIGINT held back by the agent (`held_for_workers`) is let through. Idempotent."""
    if not launched():
        return
    sys.excepthook = _quiet_exit
    if (
        SIGINT_HELD_ENV in os.environ
        and _MASKS
        and threading.current_thread() is threading.main_thread()
    ):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker deaf to the agent's stop signals.

    The tracker ignores SIGINT and SIGTERM itself, but a USR1, USR2, HUP or QUIT sent to the
    job's process group (a scheduler's stop, `kill -USR2 -<pgid>`) killed it; the agent's next
    release of its queues then started a new one, which printed a `KeyError` traceback for each
    (nine, named `/loky-...`: scikit-learn's joblib renames the semaphores). A signal mask
    survives the tracker's exec, and it unblocks only INT and TERM: these stay blocked there."""
    from multiprocessing import resource_tracker

    spared = {getattr(signal, n) for n in _TRACKER_SPARED if hasattr(signal, n)}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, spared)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def held_for_workers() -> Iterator[None]:
    """Around the agent's run in the launching process: the workers it starts inherit SIGINT
    blocked (a signal mask survives fork and exec) until `quiet_while_starting` runs in them.
    The agent still gets Ctrl-C: a thread of ours that leaves SIGINT unblocked takes the
    signal for the process, and Python runs the agent's handler in the main thread as ever."""
    if threading.current_thread() is not threading.main_thread() or not _MASKS:
        yield
        return
    # multiprocessing starts its resource tracker at the first spawn, and unblocks SIGINT in
    # the caller once it has (resource_tracker.ensure_running, bpo-33613): started now, before
    # the block, it leaves the block alone when the agent spawns the workers.
    _start_resource_tracker()
    done = threading.Event()
    # Started before the block, so its own mask keeps SIGINT open.
    catcher = threading.Thread(target=done.wait, name="sigint-catcher", daemon=True)
    catcher.start()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.environ[SIGINT_HELD_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(SIGINT_HELD_ENV, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        done.set()


# While a Ctrl-C is held (`hold` until `let_through`): the SIGINT handler it replaced, and
# whether one came.
_held: dict[str, object] = {}


def hold() -> None:
    """From now until `let_through`: a Ctrl-C is noted, not raised where it lands (inside an
    import, or Hydra writing the run dir's .hydra/), so the job's start can say its one line
    (launch/runner.py). A handler, not a signal mask: a thread that torch started
    already (a rank's TCPStore) would take a blocked SIGINT for the process. Idempotent."""
    if "previous" in _held or threading.current_thread() is not threading.main_thread():
        return
    _held["previous"] = signal.signal(signal.SIGINT, lambda *_: _held.update(caught=True))


@contextlib.contextmanager
def held_while_importing() -> Iterator[None]:
    """`hold` while a job's modules import (seconds); a Ctrl-C noted meanwhile is raised at
    the block's end if `let_through` has not raised it already."""
    hold()
    try:
        yield
    finally:
        let_through()


def let_through() -> None:
    """Put back the SIGINT handler `held_while_importing` replaced, and raise the Ctrl-C it
    noted meanwhile, if any, here."""
    if "previous" not in _held:
        return
    signal.signal(signal.SIGINT, _held.pop("previous"))  # type: ignore[arg-type]
    if _held.pop("caught", False):
        raise KeyboardInterrupt


quiet_while_starting()
