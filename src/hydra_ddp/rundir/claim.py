"""One job per run dir: global rank 0 claims `<run dir>/.claim` before anything is written there.

The claim is an OS lock on that file (`fcntl.flock`), which the kernel drops when its holder
dies however it dies, so a re-run, an elastic restart or a requeue takes over at once; a live
holder (named in the file) refuses a second job in one line. Self-launched workers hold a shared
lock too (`join`): a SIGKILLed parent's workers keep the dir until they have saved and stopped.
What the lock does not cover (node-local locks on a shared file system, a lost node):
docs/when_things_go_wrong.md.

`fcntl.flock` itself: filelock truncates the file as it opens it (it could not name the holder)
and has no shared lock; fasteners takes POSIX record locks, lost when any descriptor closes.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError

NAME = ".claim"
# How long a busy lock is tried again before the dir counts as taken: a rank checking the claim
# or a claimer stepping down to a shared lock holds it for microseconds, a job for its life.
RETRY_S = 1.0
_JOB_KEYS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SUBMITIT_JOB_ID", "SUBMITIT_LOCAL_JOB_ID")

# The dirs this process claimed -> the descriptor holding the lock (None: no locks there).
_held: dict[Path, int | None] = {}
_sweeps: set[Path] = set()
_joined: list[int] = []  # a self-launched worker's share of its parent's claim


def claim(run_dir: str | Path, key: str = "hydra.run.dir") -> None:
    """Claim `run_dir` (exit 2 with one line if a live job holds it; `key` chooses another)."""
    shown, run_dir = Path(run_dir), Path(run_dir).resolve()
    if run_dir in _held:
        return
    path = run_dir / NAME
    for _ in range(100):  # another round when its holder removed the file as we locked it
        fd = _open(path, os.O_RDWR | os.O_CREAT)
        taken = _lock(fd, fcntl.LOCK_EX)
        if taken is None:
            os.close(fd)
            sys.stderr.write(
                f"warning: {path.parent} is on a file system without file locks: a second "
                "job started in this dir would not be refused\n"
            )
            _held[run_dir] = None
            return
        if not taken:
            _refuse(shown, fd, key)
        if not _same_file(fd, path):
            os.close(fd)
            continue
        previous = _read(fd)
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job": _job_id(),
            "since": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        # Shared, so this job's workers can join. Not atomic: a claimer that got the exclusive
        # lock in between has written itself in, and the dir is its.
        fcntl.flock(fd, fcntl.LOCK_SH)
        if _read(fd) != mine:
            _refuse(shown, fd, key)
        if previous:  # a job that ended well removed the file: this one died holding it
            # Hydra has not set up logging yet (this runs as it resolves the log file's name).
            sys.stderr.write(
                f"warning: taking over {path} from a job that is gone ({_describe(previous)})\n"
            )
        _held[run_dir] = fd
        return
    raise SystemExit(f"error: could not claim {path}: other jobs keep replacing it")


def claim_sweep(sweep_dir: str | Path) -> None:
    """Claim `sweep_dir` for the whole multirun, before any job is submitted: a second sweep is
    refused at once rather than job by job."""
    claim(sweep_dir, key="hydra.sweep.dir")
    _sweeps.add(Path(sweep_dir).resolve())


def join(run_dir: str | Path) -> None:
    """A self-launched worker shares its job's lock while it can still write in `run_dir`."""
    path = Path(run_dir) / NAME
    try:
        fd = _open(path, os.O_RDONLY)
    except OSError:
        return  # no claim: its file system has no locks
    if _lock(fd, fcntl.LOCK_SH):
        _joined.append(fd)
    else:  # no locks here; or the parent died and another job took the dir: SIGTERM comes
        os.close(fd)


def wait_for_own_job(run_dir: str | Path, timeout_s: float = 60.0) -> None:
    """A rank other than 0: before writing into `run_dir`, wait (at most `timeout_s`) for its
    rank 0's claim; another live job's dir is refused at once (exit 2). Only with a job id (else
    its rank 0's claim looks like anyone's) and on rank 0's node (another may see a node-local
    dir rank 0 never claims)."""
    if _job_id() is None or not _on_first_node():
        return
    path = Path(run_dir) / NAME
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            fd = _open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            holder = _read(fd)
            if holder.get("job") == _job_id():
                os.close(fd)
                return
            # An empty file is a claimer that has not written itself in: maybe our rank 0.
            busy = bool(holder) and _lock(fd, fcntl.LOCK_EX, retry_s=0) is False
            os.close(fd)  # also drops the lock if we got it
            if busy:
                sys.stderr.write(
                    f"error: {run_dir} is in use by another job ({_describe(holder)}): this "
                    "job's rank 0 stops too; wait for that job to end, or choose another "
                    "hydra.run.dir (a sweep: hydra.sweep.dir)\n"
                )
                raise SystemExit(2)
        time.sleep(0.2)


def release_all() -> None:
    for run_dir in [d for d in _held if d not in _sweeps]:
        _give_back(run_dir)
    while _joined:
        os.close(_joined.pop())


def release_sweep() -> None:
    for sweep_dir in list(_sweeps):
        _give_back(sweep_dir)


def _give_back(run_dir: Path) -> None:
    fd = _held.pop(run_dir)
    _sweeps.discard(run_dir)
    if fd is None:
        return
    path = run_dir / NAME
    # Removed while locked: a later job finds no record of one that ended well, and a claimer
    # that opened it meanwhile sees it is gone (_same_file).
    if _same_file(fd, path) and _read(fd).get("pid") == os.getpid():
        path.unlink(missing_ok=True)
    os.close(fd)


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) lets go of the inherited locks, so the parent's
    death frees the dir at once."""
    for fd in [*_held.values(), *_joined]:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _held.clear()
    _sweeps.clear()
    _joined.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _open(path: Path, flags: int) -> int:
    """The claim file's descriptor. A FIFO there would block reads for ever: exit 2 in one line
    (and no blocking should one appear after the check)."""
    try:
        check_regular(path, "the claim file", f"delete it (a job's claim on {path.parent} is "
                      "a regular file that the job writes)")  # fmt: skip
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
    return os.open(path, flags | os.O_NONBLOCK, 0o644)


def _lock(fd: int, how: int, retry_s: float = RETRY_S) -> bool | None:
    """Take lock `how`, retrying for `retry_s` while busy: True when taken, False when busy,
    None where the file system has no locks."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        except OSError:  # ENOLCK, EOPNOTSUPP, ...: Lustre without `-o flock`, some FUSE
            return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    locked = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (locked.st_dev, locked.st_ino)


def _read(fd: int) -> dict[str, Any]:
    try:
        found = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _job_id() -> str | None:
    for key in _JOB_KEYS:
        if key in os.environ:
            return f"{key}={os.environ[key]}"
    return None


def _refuse(run_dir: Path, fd: int, key: str) -> None:
    holder = _read(fd)
    os.close(fd)
    since = holder.get("since")
    when = time.strftime(", since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
    note, host = "", holder.get("host")
    if host == socket.gethostname():
        if not _pid_exists(holder.get("pid")):
            note = " (a process of that job still runs: its workers stop after saving)"
    elif host:  # a lock on a shared file system: a lost node's may outlive it (NFSv3)
        note = f"; if {host} is down for good, delete {run_dir / NAME}"
    sys.stderr.write(
        f"error: {run_dir} is in use by another job ({_describe(holder)}{when}): wait for it "
        f"to end, or choose another {key}{note}\n"
    )
    raise SystemExit(2)


def _pid_exists(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        pass  # another user's process; no pid recorded
    return True


def _on_first_node() -> bool:
    """On the launcher's first node, where rank 0 is (unknown: assumed so)."""
    for key in ("GROUP_RANK", "SLURM_NODEID", "SUBMITIT_LOCAL_NODEID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key]) == 0
    return True


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "a job that is starting"
    who = f"pid {holder.get('pid')} on {holder.get('host')}"
    return who + (f" ({holder['job']})" if holder.get("job") else "")
