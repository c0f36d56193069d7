"""A rank's failure as one line: a dead peer, a timed-out collective, a dead DataLoader
worker, a full disk, DDP's paragraphs (`translated`, around training and evaluation), and the
launcher's line naming the rank that failed first (`worker_failed`; docs/when_things_go_wrong.md,
"Which rank failed")."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import traceback
from pathlib import Path
from typing import Iterator

from hydra_ddp.disk import _WRITE_ERRNOS, file_too_large, write_advice
from hydra_ddp.errors import Stopped, UserError, first_line

# Words of the messages that say a rank failed *because of* another one: the launcher blames
# such a rank only when no rank said anything better (`worker_failed`).
LOST_CONTACT = "lost contact with another rank"
WAITED = "for another rank in a collective"

# What a collective raises when another rank died mid-job (gloo's closed socket, NCCL's
# watchdog); tests/test_error_messages.py produces each of these and of _TIMED_OUT's for real.
_LOST_PEER = (
    "Connection closed by peer",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
    "ncclRemoteError",
)
# gloo's read and write errors quote the OS (`Read error <peer>: <strerror>`): matched by the
# OS's own text for these errnos, never a copy of it.
_LOST_PEER_ERRNOS = (errno.ECONNRESET, errno.EPIPE)
# What a collective raises when a peer is alive but stopped answering for dist.timeout_s.
_TIMED_OUT = (
    "Timed out waiting",
    "Application timeout caused pair closure",
    "Watchdog caught collective operation timeout",
)


def lost_peer(e: BaseException) -> bool:
    """True for the error a collective raises when another rank died mid-job."""
    if not isinstance(e, RuntimeError):
        return False
    text = str(e)
    return any(s in text for s in _LOST_PEER) or any(
        os.strerror(n) in text for n in _LOST_PEER_ERRNOS
    )


def timed_out(e: BaseException) -> bool:
    """True for the error a collective raises when a live peer stopped answering (SIGSTOP, a
    hung filesystem, a much slower rank) for longer than the timeout."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _TIMED_OUT)


def _loader_died(e: BaseException) -> bool:
    """True when one of the rank's DataLoader workers was killed: torch's own RuntimeError, or a
    broken connection while fetching from it."""
    if isinstance(e, RuntimeError) and "DataLoader worker" in str(e):
        return True
    if not isinstance(e, (ConnectionError, EOFError)):
        return False
    data_dir = f"torch{os.sep}utils{os.sep}data{os.sep}"
    return any(data_dir in frame.filename for frame in traceback.extract_tb(e.__traceback__))


def one_line(
    e: BaseException, rank: int, timeout_s: float, output_dir: Path, doing: str = ""
) -> UserError | None:
    """The one-line UserError for an exception raised while a rank trains (or, `doing`, while
    it evaluates or predicts), or None when it has no better message than its own traceback."""
    if isinstance(e, UserError):
        return e
    if isinstance(e, RuntimeError) and "Expected to have finished reduction" in str(e):
        return unused_parameters([])  # DDP's own is a paragraph about reductions and buckets
    if lost_peer(e) and doing:  # no restart suggested: restarts resume training
        return UserError(
            f"rank {rank} {LOST_CONTACT} while {doing} ({first_line(e)}): that rank most "
            f"likely failed, see its log in {output_dir} (eval_rank<r>.log) for why"
        )
    if lost_peer(e):
        # Every survivor of a dead rank gets the same collective traceback, which says nothing
        # about the cause.
        return UserError(
            f"rank {rank} {LOST_CONTACT} ({first_line(e)}): that rank most "
            "likely died, see its log for why; with torchrun --max-restarts=K (or "
            "dist.max_restarts=K) the group restarts and resumes from the newest checkpoint"
        )
    if _loader_died(e):
        return UserError(
            f"a DataLoader worker of rank {rank} died ({first_line(e)}): most often the "
            "out-of-memory killer (see `dmesg`); lower trainer.num_workers or what each worker "
            "holds, or trainer.num_workers=0 to load in the rank itself"
        )
    if isinstance(e, OSError) and e.errno == errno.EFBIG:
        return UserError(file_too_large(e.filename or f"a file in {output_dir}"))
    if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
        return UserError(
            f"could not write {os.fsdecode(e.filename) if e.filename else output_dir} "
            f"({e.strerror}): {write_advice(e.errno)}; the checkpoints already written are "
            "intact"
        )
    if timed_out(e):
        return UserError(
            f"rank {rank} waited dist.timeout_s={timeout_s:g}s {WAITED} "
            f"({first_line(e)}): a rank stopped answering (stopped, hung on I/O, or "
            "far slower than the others), see the other ranks' logs; raise dist.timeout_s if "
            "one rank legitimately works that long alone"
        )
    return None


@contextlib.contextmanager
def translated(
    rank: int, timeout_s: float, output_dir: Path, doing: list[str] | None = None
) -> Iterator[None]:
    """Re-raise what `one_line` can say in one line as that UserError (the original chained as
    its cause, for the rank's log). The error is recorded for the launcher here, before the
    group is torn down: the peers' "lost contact" comes after it. For evaluation and
    prediction, `doing[0]` says what the rank is doing (updated by the caller as it moves on)
    and every exception becomes one line naming it, its traceback in the rank's log."""
    try:
        yield
    except Exception as e:
        better = one_line(e, rank, timeout_s, output_dir, doing[0] if doing else "")
        if doing and better is not e:
            log = logging.getLogger(__name__)
            log.info("rank %d: the traceback of the error", rank, exc_info=e)
        if doing and better is None:
            better = UserError(
                f"rank {rank} failed while {doing[0]}: {type(e).__name__}: {first_line(e)} "
                "(its traceback is in this rank's log)"
            )
        write_rank_error(better or e, rank, Path(output_dir) / "errors")
        if better is None or better is e:
            raise
        raise better from e


def unused_parameters(names: list[str]) -> UserError:
    """DDP's "Expected to have finished reduction" paragraph, with the parameters named."""
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return UserError(
        f"some model parameters got no gradient in a step{f' ({shown})' if shown else ''} and "
        "DDP was not told to "
        "expect that: use ddp=unused_params (sets ddp.find_unused_parameters=true), freeze "
        "them (requires_grad=False), or make every parameter take part in the loss"
    )


def write_rank_error(e: BaseException, rank: int, errors_dir: Path) -> None:
    """Write why this rank failed to `errors_dir/rank<r>.txt` (one line; its mtime says when)
    for `worker_failed`: only where the self-launch made that dir, and only the rank's first
    error (a failed teardown after it is not the cause)."""
    path = errors_dir / f"rank{rank}.txt"
    if isinstance(e, Stopped) or not errors_dir.is_dir() or path.exists():
        return
    why = str(e) if isinstance(e, UserError) else f"unexpected error: {type(e).__name__}: "
    if not isinstance(e, UserError):
        why += first_line(e)
    try:
        path.write_text(why.replace("\n", " ") + "\n")
    except OSError:  # a full disk: the rank's log has the error; the launcher names the exit
        path.unlink(missing_ok=True)  # code (an empty file would read as an empty cause)


def worker_failed(
    exit_codes: dict[int, int], said_dir: Path, output_dir: Path, log_stem: str = "train"
) -> UserError:
    """The launcher's one line for a failed worker group (`exit_codes`: failed rank -> exit
    code, as the agent lists them). It names the rank whose own error came first
    (`said_dir/rank<r>.txt`, by mtime); else one that died without a word (a C++ abort, the
    OOM killer) while the others lost contact with it; else the first that timed out or lost
    contact."""
    said: dict[int, tuple[int, str]] = {}
    for p in said_dir.glob("rank*.txt"):
        rank_text = p.stem[len("rank") :]
        try:
            # Not a FIFO (it would block the launcher), nor empty (no cause in it).
            if rank_text.isdigit() and p.is_file() and (text := p.read_text().strip()):
                said[int(rank_text)] = (p.stat().st_mtime_ns, text)
        except OSError:
            continue
    own = {r: v for r, v in said.items() if LOST_CONTACT not in v[1] and WAITED not in v[1]}
    silent = sorted(r for r in exit_codes if r not in said)
    lost = any(LOST_CONTACT in v[1] for v in said.values())
    if own:
        rank = min(own, key=lambda r: (own[r][0], r))
    elif silent and (lost or not said):
        rank = silent[0]
    elif said:
        rank = min(said, key=lambda r: (said[r][0], r))
    else:
        rank = min(exit_codes)
    why = said[rank][1] if rank in said else _exit_reason(exit_codes[rank])
    return UserError(
        f"worker rank {rank} failed: {why} (log: {output_dir / f'{log_stem}_rank{rank}.log'})"
    )


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (
            f"killed by {name} without an error of its own (exit code {code}): see the end of "
            "its log (SIGKILL: often the out-of-memory killer; SIGABRT: a crash in C++, e.g. "
            "ranks calling different collectives)"
        )
    return f"exit code {code}"
