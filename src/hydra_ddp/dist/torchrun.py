"""`python -m hydra_ddp.dist.torchrun ARGS`: torchrun, whose stop on a signal exits like its workers.

torchrun's agent, on SIGTERM (a scheduler's stop) or SIGINT, forwards the signal to its
workers and waits for them (`--shutdown-timeout`, 30 s by default), then lets torch's
`SignalException` out of its main: a traceback and exit status 1, although the workers saved a
checkpoint and exited 143 (130 for Ctrl-C). Its options cannot change that: a signal left out
of `--signals-to-handle` kills the agent at once, without forwarding it or waiting for the
checkpoint.

This runs torchrun itself (`torch.distributed.run.main`, what the `torchrun` command runs, with
the same arguments) and turns that exception into the status of a process stopped by the
signal, 128 + its number, without a traceback or the agent's shutdown notes: the workers' own
line (rank 0's `stopped on SIGTERM at step N of M with a checkpoint: ...`) is the last word.
"""

from __future__ import annotations

import logging
import sys

# torch's elastic agent (torchrun, and the self-launch's agent in launch.py) and what it logs
# as it stops its workers on a signal: the job's own line says it once.
AGENT_LOGS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)
_STOP_NOTES = (
    "Received %s death signal",
    "Closing process %s via signal",
    "Sending process %s closing signal",
)


def drop_stop_notes(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_STOP_NOTES)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.run import main as torchrun

    for name in AGENT_LOGS:
        logging.getLogger(name).addFilter(drop_stop_notes)
    try:
        torchrun(argv)
    except SignalException as e:
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
