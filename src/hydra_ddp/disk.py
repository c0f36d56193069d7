"""The files of a run dir as a user may have left them, and why a write there failed.

Every file the template opens in a run dir must be a regular file (`check_regular`,
`open_regular`): a FIFO blocks whoever opens it, with no timeout, and a socket or a device is
no checkpoint either. A failed write says what the OS said ("No space left on device"), which
torch.save hides in its error's context and DCP in each rank's failure (`os_cause`), and what
to do (`write_advice`, `file_too_large`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import IO, Any

from hydra_ddp.errors import UserError, first_line

_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def write_advice(code: int | None) -> str:
    """What to do about a failed write into the run dir, by its errno: a read-only or foreign
    dir wants no free space."""
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (
            "it is read-only or not yours: make it writable, or resume in another dir "
            "(hydra.run.dir=...)"
        )
    return "free space or quota there, or resume in another dir (hydra.run.dir=...)"


def check_regular(path: Path, what: str, fix: str) -> None:
    """Refuse `path` in one line unless it is a regular file (or missing: the caller says
    that)."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        return
    kind = (
        "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
        else "a socket" if stat.S_ISSOCK(mode)
        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a directory" if stat.S_ISDIR(mode)
        else "not a regular file"
    )  # fmt: skip
    raise UserError(f"{what} {path} is {kind}, not a regular file: {fix}")


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (`ulimit -f`, RLIMIT_FSIZE), None if unlimited."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def over_size_limit(e: BaseException, path: Path) -> bool:
    """True when a failed write of `path` hit the file-size limit: EFBIG, or (torch.save
    reports any failed write as a RuntimeError without its errno) a file that reached it."""
    if isinstance(e, OSError):
        return e.errno == errno.EFBIG
    limit = file_size_limit()
    try:
        return limit is not None and path.stat().st_size >= limit - 4096
    except OSError:
        return False


def file_too_large(path: object) -> str:
    limit = file_size_limit()
    cap = f"at most {limit} bytes per file" if limit is not None else "a size limit"
    return (
        f"could not write {path}: file too large (this job may write {cap}: `ulimit -f`, "
        "or the file system's own limit): raise the limit (`ulimit -f unlimited` before "
        "starting, or ask the cluster's admins), or write smaller files"
    )


def open_regular(path: Path, mode: str = "r", *, what: str, fix: str, **kwargs: Any) -> IO[Any]:
    """open(), refusing anything but a regular file (or a missing one) in one line."""
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


def write_failed(e: BaseException, path: Path, folder: Path | None = None) -> UserError:
    """The one line for a checkpoint write that failed; `folder`: see why_write_failed."""
    code, why = why_write_failed(e, folder)
    return UserError(
        f"could not write checkpoint {path} ({why}): {write_advice(code)}; the checkpoints "
        "already there are intact"
    )


def why_write_failed(e: BaseException, folder: Path | None = None) -> tuple[int | None, str]:
    """A failed write's errno and cause in a few words: the OS's, else (DCP pickles each rank's
    failure, dropping its context) a full disk told from the free space in `folder`, else the
    library's first line (errno None)."""
    cause = os_cause(e)
    if cause is not None and cause.strerror:
        return cause.errno, cause.strerror
    try:
        if folder is not None and shutil.disk_usage(folder).free < 1 << 20:
            return errno.ENOSPC, os.strerror(errno.ENOSPC)
    except OSError:
        pass
    return None, first_line(e)


def remove_quietly(path: Path) -> None:
    """Remove a partial file of a failed write (it holds the space a full disk needs back)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def before(path: Path) -> Path:
    """The first free `<name>.before-<n>` beside `path`: where what an earlier run left there
    goes (nothing made earlier is deleted or overwritten)."""
    n = 1
    while (aside := path.with_name(f"{path.name}.before-{n}")).exists():
        n += 1
    return aside
