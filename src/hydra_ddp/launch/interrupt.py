"""Ctrl-C while a launched worker starts: a clean exit 130, not a traceback from every worker.

A worker spends seconds importing torch before the loop's signal handlers take over, and the
terminal's Ctrl-C reaches every process of the job. Importing this module (train.py does it
first) makes a KeyboardInterrupt that ends a launched process exit 130 silently: the launcher
says the one line. The self-launch's agent starts its workers with SIGINT blocked until then
(`held_for_workers`). Standard library only: imported before torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from types import TracebackType
from typing import Iterator

from hydra_ddp.launcher_env import AGENT_SIGNALS, SIGINT_HELD_ENV, torchrun_worker

EXIT_CODE = 128 + signal.SIGINT

_previous_hook = sys.excepthook
# The stop signals the agent handles besides INT and TERM.
_TRACKER_SPARED = tuple(n for n in AGENT_SIGNALS.split(",") if n not in ("SIGINT", "SIGTERM"))


def ignore_more() -> None:
    """After the first Ctrl-C: the same one comes again (forwarded by the agent)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _quiet_exit(kind: type[BaseException], value: BaseException, tb: TracebackType | None):
    if not issubclass(kind, KeyboardInterrupt):
        return _previous_hook(kind, value, tb)
    ignore_more()
    # Under torchrun nobody else says it; under the self-launch the launching process does.
    if os.environ.get("RANK") == "0" and torchrun_worker():
        sys.stderr.write("stopped on SIGINT while starting, before any step was trained\n")
    exit_now(EXIT_CODE)


def exit_now(code: int) -> None:
    """Exit `code` at once, logs and streams flushed: the interpreter's teardown of torch can
    take tens of seconds (past a launcher's grace) or abort a finished rank."""
    with contextlib.suppress(Exception):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def quiet_while_starting() -> None:
    """In a launched worker: an uncaught KeyboardInterrupt exits 130 quietly, and a SIGINT the
    agent held back is let through. Idempotent."""
    held = SIGINT_HELD_ENV in os.environ
    if not (torchrun_worker() or held):
        import multiprocessing

        if multiprocessing.parent_process() is None:  # nor a child of a launched worker
            return
    sys.excepthook = _quiet_exit
    if held and threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def held_for_workers() -> Iterator[None]:
    """Around the agent's run: its workers inherit SIGINT blocked until `quiet_while_starting`
    runs in them. The agent still gets Ctrl-C through a thread that leaves it unblocked."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    # Started now, since its start unblocks SIGINT in the caller (bpo-33613), and deaf to the
    # agent's other stop signals: a USR1 to the job's process group would kill it, and its
    # replacement print a KeyError traceback per semaphore. Its exec keeps this mask.
    spared = {getattr(signal, n) for n in _TRACKER_SPARED}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, spared)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
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


# While a Ctrl-C is held: the SIGINT handler it replaced, and whether one came.
_held: dict[str, object] = {}


def hold() -> None:
    """Until `let_through`, a Ctrl-C is noted, not raised where it lands (inside an import), so
    the job's start can say its line. A handler, not a mask: a torch thread (a TCPStore) would
    take a blocked SIGINT. Idempotent."""
    if "previous" in _held or threading.current_thread() is not threading.main_thread():
        return
    _held["previous"] = signal.signal(signal.SIGINT, lambda *_: _held.update(caught=True))


def let_through() -> None:
    """Put back the SIGINT handler `hold` replaced, and raise the Ctrl-C it noted, if any."""
    if "previous" not in _held:
        return
    signal.signal(signal.SIGINT, _held.pop("previous"))  # type: ignore[arg-type]
    if _held.pop("caught", False):
        raise KeyboardInterrupt


quiet_while_starting()
