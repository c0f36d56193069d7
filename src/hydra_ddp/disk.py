"""The files of a run dir as a user may have left them, and why a write there failed.

* `open_regular` / `check_regular`: every file the template opens in a run dir (checkpoints,
  stats, summary.json, wandb_ids.json, the claim, the logs) must be a regular file. A FIFO
  there blocks whoever opens it until a writer comes, with no timeout (the job hangs, and its
  claim keeps the dir locked); a socket or a device is no checkpoint either. Each
  is refused in one line naming the file and what to do.
* `os_cause`: the OSError behind a library's write error. torch.save reports a full disk as
  "unexpected pos 263744 vs 263664" (the OSError is its context); DCP collects every rank's
  failure into a CheckpointException. The user needs "No space left on device".
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import IO, Any

from hydra_ddp.errors import UserError, check_regular, write_advice

__all__ = [
    "check_regular",
    "open_regular",
    "os_cause",
    "read_regular",
    "remove_quietly",
    "why_write_failed",
    "write_failed",
]


def open_regular(path: Path, mode: str = "r", *, what: str, fix: str, **kwargs: Any) -> IO[Any]:
    """open(), refusing in one line (`<what> <path> is a FIFO (named pipe), not a regular
    file: <fix>`) anything but a regular file or, for a mode that creates, a missing one."""
    check_regular(path, what, fix)
    return open(path, mode, **kwargs)


def read_regular(path: Path, *, what: str, fix: str) -> str:
    """A text file's content (FileNotFoundError when missing, as read_text)."""
    with open_regular(path, what=what, fix=fix, encoding="utf-8") as handle:
        return handle.read()


def os_cause(e: BaseException) -> OSError | None:
    """The OSError (with an errno) that `e` was raised from: `e` itself, its cause or context,
    or one of the ranks' failures of a DCP CheckpointException (its `failures`: rank ->
    exception or (exception, traceback))."""
    todo: list[Any] = [e]
    seen: set[int] = set()
    while todo:
        error = todo.pop(0)
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error
        todo += [error.__cause__, error.__context__]
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return None


def why_write_failed(e: BaseException, folder: Path | None = None) -> str:
    """A failed write's cause in a few words: the OS's ("No space left on device",
    "Read-only file system"), else, for a library that kept no cause (DCP pickles each rank's
    failure to every rank, dropping its context), a full disk told from the free space in
    `folder` (asked before the partial files are removed), else the library's first line."""
    return _cause(e, folder)[1]


def write_failed(e: BaseException, path: Path, folder: Path | None = None) -> UserError:
    """The one line for a checkpoint write that failed; `folder`: see why_write_failed."""
    code, why = _cause(e, folder)
    return UserError(
        f"could not write checkpoint {path} ({why}): {write_advice(code)}; the checkpoints "
        "already there are intact"
    )


def _cause(e: BaseException, folder: Path | None) -> tuple[int | None, str]:
    cause = os_cause(e)
    if cause is not None and cause.strerror:
        return cause.errno, cause.strerror
    try:
        if folder is not None and shutil.disk_usage(folder).free < 1 << 20:
            return errno.ENOSPC, os.strerror(errno.ENOSPC)
    except OSError:
        pass
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return None, lines[0][:200] if lines else type(e).__name__


def remove_quietly(path: Path) -> None:
    """Remove a partial file of a failed write (it holds the space a full disk needs back)."""
    try:
        os.unlink(path)
    except OSError:
        pass
