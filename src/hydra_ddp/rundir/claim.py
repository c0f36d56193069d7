"""One job per run dir: global rank 0 claims `<run dir>/.claim` before anything is written there.

A second job started in a dir that a live job holds (a user re-running a command in a second
terminal, a resubmitted SLURM job whose first copy still runs) stops in one line naming the
holder. A claim whose holder is gone is taken over with a warning, so a restart still resumes:
a dead process on this host, a claim of the same launcher job (torchrun's elastic restart,
SLURM's requeue: same job id), or one whose heartbeat (the file's mtime, refreshed every
`HEARTBEAT_S` by its holder) stopped on another host (a lost node).

"Gone" means every process of the job: the claimer and each worker that writes into the dir
hold a shared `flock` on the claim file (`join`), which the kernel drops when a process dies,
however it dies. A claim whose lock is still held is never taken over, even when its claimer's
pid is dead: the workers of a SIGKILLed self-launch parent go on until they have saved and
stopped (they get SIGTERM: preemption.exit_with_parent), and a restart in that second would
otherwise write the same checkpoints and stats as they do.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from hydra_ddp.disk import check_regular
from hydra_ddp.errors import UserError

NAME = ".claim"
HEARTBEAT_S = 30.0
STALE_S = 4 * HEARTBEAT_S
_held: dict[Path, threading.Event] = {}
_locks: list[int] = []  # open descriptors of the claim files this process holds a lock on
# The sweep dirs this process launches sweeps into: held apart from the job claims, which a job
# run in this process (the basic launcher) gives back as it ends.
_sweeps: dict[Path, tuple[threading.Event, int]] = {}


def _job_id() -> str | None:
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SUBMITIT_JOB_ID", "SUBMITIT_LOCAL_JOB_ID"):
        if key in os.environ:
            return f"{key}={os.environ[key]}"
    return None


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": _job_id(),
        "since": time.time(),
    }


def _alive(holder: dict[str, Any], path: Path) -> bool:
    if holder.get("job") and holder.get("job") == _job_id():
        return False  # an earlier attempt of this very job (restart, requeue)
    if holder.get("host") == socket.gethostname():
        try:
            return pid_alive(int(holder["pid"]))
        except (KeyError, ValueError, TypeError):
            return True  # a claim we cannot read a pid from: not ours to take
    try:  # another host: alive while its heartbeat is
        return time.time() - path.stat().st_mtime < STALE_S
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process `pid` (on this host) still runs. A zombie does not: it has exited and
    closed its files, and waits only for its parent to reap it. The workers of a SIGKILLed
    launcher are reparented to PID 1, which may reap late (this VM's init: up to 2 s) or never
    (a container with no init), and a re-run in that window must still resume."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # another user's live process


def claim(run_dir: str | Path, key: str = "hydra.run.dir") -> None:
    """Claim `run_dir` for this process (exit 2 with one line if a live job holds it; `key`:
    the setting that chooses another dir)."""
    run_dir = Path(run_dir)
    path = run_dir / NAME
    if run_dir in _held:
        return
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            _refuse_unless_regular(path)
            try:
                holder = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            busy = _still_held(path)
            if busy or (holder and _alive(holder, path)):
                still = " (a process of that job still runs: its workers stop after saving)"
                sys.stderr.write(
                    f"error: {run_dir} is in use by another job ({_describe(holder)}, since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('since', 0)))}"
                    f"){still if busy and not _alive(holder, path) else ''}: wait for it to end, "
                    f"or choose another {key}; if that job is gone, delete {path}\n"
                )
                raise SystemExit(2) from None
            # Hydra has not set up logging yet (this runs as it resolves the log file's name).
            sys.stderr.write(
                f"warning: taking over {path} from a job that is gone ({_describe(holder)})\n"
            )
            path.unlink(missing_ok=True)
            continue
        os.write(fd, json.dumps(_me()).encode())
        _lock_shared(fd)
        stop = threading.Event()
        _held[run_dir] = stop
        threading.Thread(target=_heartbeat, args=(path, stop), daemon=True).start()
        return
    raise SystemExit(f"error: could not claim {path}: another job keeps taking it")


def _refuse_unless_regular(path: Path) -> None:
    """Exit 2 with one line when the claim file is a FIFO, a socket or a device: reading it
    (a FIFO) would wait for ever, and no job of this template made it."""
    try:
        check_regular(path, "the claim file", f"delete it (a job's claim on {path.parent} is "
                      "a regular file that the job writes)")  # fmt: skip
    except UserError as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None


def _lock_shared(fd: int) -> None:
    """Hold a shared lock on the claim file through `fd` for the life of this process."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pass  # a file system without locks: the pid and heartbeat rules still apply
    _locks.append(fd)


def _still_held(path: Path) -> bool:
    """True while some process (of any host sharing the file system's locks) holds the claim
    file's lock: the job that made it is not gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO: no wait for a writer
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # no locks here: the pid and heartbeat rules decide
    finally:
        os.close(fd)  # also drops the lock we got
    return False


def join(run_dir: str | Path) -> None:
    """A worker of the job that claimed `run_dir` (a self-launched rank): hold the claim's lock
    too, so the dir is not taken over while this process can still write there."""
    path = Path(run_dir) / NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO: no wait for a writer
    except OSError:
        return  # no claim (a run dir from before claims): nothing to hold
    _lock_shared(fd)


def wait_for_own_job(run_dir: str | Path, timeout_s: float = 60.0) -> None:
    """A rank other than 0 of a launcher's job: before writing into `run_dir`, wait (at most
    `timeout_s`) until its rank 0 holds the dir's claim. A dir a live job of another launcher
    holds is refused at once in one line (exit 2), instead of this rank writing its log into
    that job's files and then waiting for a rank 0 that refused. No claim within the time (a
    rank 0 that failed before claiming): go on, the process group's timeout applies.

    Only where the wait can tell: with no job id its own rank 0's claim looks like anyone's,
    and a rank on another node than rank 0 may see a node-local dir that rank 0 never
    claims, so neither waits (a minute at every start, otherwise)."""
    if _job_id() is None or not _on_first_node():
        return
    path = Path(run_dir) / NAME
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _refuse_unless_regular(path)
        try:
            holder = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            holder = None
        if holder is not None:
            if holder.get("job") and holder.get("job") == _job_id():
                return
            if _still_held(path) or (holder and _alive(holder, path)):
                sys.stderr.write(
                    f"error: {run_dir} is in use by another job ({_describe(holder)}): this "
                    "job's rank 0 stops too; wait for that job to end, or choose another "
                    "hydra.run.dir (a sweep: hydra.sweep.dir)\n"
                )
                raise SystemExit(2)
        time.sleep(0.2)


def _on_first_node() -> bool:
    """Whether this process runs on the launcher's first node, where rank 0 is (torchrun's
    GROUP_RANK, SLURM's node id, submitit's local node id; unknown: assumed so)."""
    for key in ("GROUP_RANK", "SLURM_NODEID", "SUBMITIT_LOCAL_NODEID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key]) == 0
    return True


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unreadable claim"
    who = f"pid {holder.get('pid')} on {holder.get('host')}"
    return who + (f" ({holder['job']})" if holder.get("job") else "")


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(path)
        except OSError:
            return


def claim_sweep(sweep_dir: str | Path) -> None:
    """The process that launches a multirun: claim `sweep_dir` for the whole sweep, before
    anything is written there or any job is submitted. A second sweep into the dir of a live
    one is so refused at once, in one line (exit 2), instead of after each of its jobs has
    started (submitit's start-up) and found its job dir taken."""
    sweep_dir = Path(sweep_dir)
    if sweep_dir in _sweeps:
        return
    claim(sweep_dir, key="hydra.sweep.dir")
    # Moved apart from the job claims; claim() appended its lock's descriptor last.
    _sweeps[sweep_dir] = (_held.pop(sweep_dir), _locks.pop())


def release_sweep() -> None:
    """Give back the sweep dirs this process claimed (the end of the multirun)."""
    for sweep_dir, (stop, fd) in list(_sweeps.items()):
        _give_back(sweep_dir, stop)
        os.close(fd)
        _sweeps.pop(sweep_dir, None)


def _give_back(run_dir: Path, stop: threading.Event) -> None:
    stop.set()
    path = run_dir / NAME
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def release_all() -> None:
    """Give back this process's job claims (the end of the job)."""
    for run_dir, stop in list(_held.items()):
        _give_back(run_dir, stop)
        _held.pop(run_dir, None)
    while _locks:
        os.close(_locks.pop())
