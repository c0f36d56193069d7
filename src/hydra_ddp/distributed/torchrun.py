"""`python -m hydra_ddp.distributed.torchrun ARGS`: torchrun (`torch.distributed.run.main`, the
same arguments) whose stop on a signal exits 128 + the signal, without torch's
`SignalException` traceback, and whose agent also forwards SIGUSR1 and SIGUSR2 unless told
otherwise (docs/when_things_go_wrong.md, "Preemption and Ctrl-C")."""

from __future__ import annotations

import logging
import os
import sys

from hydra_ddp.distributed.preemption import stop_exit_codes
from hydra_ddp.launcher_env import AGENT_SIGNALS

# torch's elastic agent (torchrun, and the self-launch's agent in launch/runner.py) and what
# it logs as it stops its workers on a signal: the job's own line says it once.
AGENT_LOGS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)
_STOP_NOTES = (
    "Received %s death signal",
    "Closing process %s via signal",
    "Sending process %s closing signal",
)
_SIGNALS_OPTION = ("--signals-to-handle", "--signals_to_handle")
_FAILED = "failed (exitcode: %s)"


def drop_stop_notes(record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    if msg.startswith(_FAILED):  # a worker that stopped on a signal has not failed
        args = record.args if isinstance(record.args, tuple) else ()
        return not (args and args[0] in stop_exit_codes())
    return not msg.startswith(_STOP_NOTES)


def stop_status(exit_codes: object) -> int | None:
    """The status to exit with when every failed worker stopped on one of the stop signals
    (with its checkpoint): 128 + the signal; None when any failed otherwise."""
    codes = set(exit_codes)  # type: ignore[call-overload]
    return max(codes) if codes and codes <= stop_exit_codes() else None


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    for name in AGENT_LOGS:
        logging.getLogger(name).addFilter(drop_stop_notes)
    argv = sys.argv[1:] if argv is None else argv
    told = any(a.split("=")[0] in _SIGNALS_OPTION for a in argv)
    if not told and "PET_SIGNALS_TO_HANDLE" not in os.environ:
        # The agent handles AGENT_SIGNALS; first, so that a later option of the user's, or the
        # script's own arguments, come after it.
        argv = [f"{_SIGNALS_OPTION[0]}={AGENT_SIGNALS}", *argv]
    try:
        torchrun(argv)
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        status = stop_status(f.exitcode for f in e.failures.values())
        if status is None:
            raise
        sys.exit(status)


if __name__ == "__main__":
    main()
