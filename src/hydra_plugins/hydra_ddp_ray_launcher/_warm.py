"""Warm job starts: a process that has imported torch, Hydra and the template once, and forks
one child per job.

A job of a sweep is short; importing torch, Hydra and the project in a fresh interpreter costs
10-15 s on a small machine, which Hydra's basic launcher pays once per sweep and a process per
job would pay every time. So each Ray worker keeps one of these (per thread count), started on
its first job, and each job runs in a child forked from it: the imports are done, and the
child starts from the same untouched state every time (the parent never runs a job), so nothing
one job sets (a global, a seed, a signal handler, a cache) reaches the next. After each job the
parent also imports the installed libraries that job loaded as it ran (a data set's
scikit-learn, torch's lazily loaded parts; never the template's or a user's modules, which may
change between sweeps), so the next job does not pay them either.

What a fresh `python -m` process would have, the child sets before the job runs: its own
session (its ranks are its process group, which the task clears at the end), the job's
environment (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, ...), working dir and `sys.path[0]`, fresh
Python and numpy seeds. The parent imports no CUDA, so each child's CUDA_VISIBLE_DEVICES
counts; OpenMP's thread count is fixed when a library loads, so a parent serves one count.

The protocol, one line each way: the task writes `{"spec":…, "result":…, "env":…, "cwd":…}`
as JSON; the parent answers `pid <n>` for the child it forked, then `exit <n> <status>` when it
ends (status as `subprocess` gives it: -signal when killed).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

# Beside a job's result file: the libraries it imported (`_tell_imported`).
_IMPORTED = ".imported"


def fingerprint() -> str:
    """What the warm parent imported: the template's sources, by name, size and mtime. A warm
    parent whose fingerprint no longer matches (the code was edited between two sweeps on a
    cluster that outlives them) is replaced, so a job never runs yesterday's code."""
    import hydra_ddp

    root = Path(hydra_ddp.__file__).parent
    stats = sorted(
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*.py")
    )
    return str(hash(tuple(stats)))


class Warm:
    """The task's handle on one warm parent (a Ray worker keeps one per thread count)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        self.print = fingerprint()
        self._exits: dict[int, int] = {}
        self._buffer = b""
        ready = self._line(time.monotonic() + 300.0)
        if ready != "ready":
            raise RuntimeError(f"the warm job process did not start ({ready!r})")

    def usable(self) -> bool:
        return self.proc.poll() is None and self.print == fingerprint()

    def start(self, spec_path: str, result_path: str, env: dict[str, str], cwd: str) -> Child:
        """Fork a child for one job."""
        request = {"spec": spec_path, "result": result_path, "env": env, "cwd": cwd}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        deadline = time.monotonic() + 60.0
        while True:
            line = self._line(deadline)
            if line is None or line.startswith("pid "):
                break
            self._note(line)
        if line is None:
            raise RuntimeError("the warm job process did not fork the job")
        return Child(self, int(line.split()[1]))

    def wait(self, pid: int, timeout: float) -> Optional[int]:
        """The child's exit status once it ended, else None after `timeout` seconds (0: what
        the parent has said so far)."""
        deadline = time.monotonic() + timeout
        while pid not in self._exits:
            line = self._line(deadline)
            if line is None:
                break
            self._note(line)
        if pid not in self._exits and self.proc.poll() is not None:
            return -signal.SIGKILL  # the parent died: its children were killed with it
        return self._exits.pop(pid, None)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _note(self, line: str) -> None:
        if line.startswith("exit "):
            _, child, status = line.split()
            self._exits[int(child)] = int(status)

    def _line(self, deadline: float) -> Optional[str]:
        """The parent's next line, or None when none came by `deadline` (or it is gone).
        Read unbuffered: a buffered reader could hold a line that select no longer sees."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            data = os.read(fd, 4096)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()


class Child:
    """A forked job, as the task handles a `subprocess.Popen` of one (the same calls)."""

    def __init__(self, parent: Warm, pid: int) -> None:
        self.parent, self.pid = parent, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.parent.wait(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self.parent.wait(self.pid, 1e9 if timeout is None else timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"job pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _child(request: dict[str, Any], protocol: int) -> int:
    """In the forked child: become what a fresh process of the job would be, run the job."""
    import random

    import numpy
    import torch

    from hydra_plugins.hydra_ddp_ray_launcher import _job

    os.close(protocol)  # the parent's line to the task is not the job's
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # where `python -m` would look first
    random.seed()
    numpy.random.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    before = set(sys.modules)
    try:
        return _job.main(request["spec"], request["result"])
    finally:
        _tell_imported(sorted(set(sys.modules) - before), request["result"] + _IMPORTED)


def _tell_imported(names: list[str], path: str) -> None:
    """The installed libraries this job imported as it ran (a data set's scikit-learn, torch's
    lazily loaded parts): the parent imports them too, so the next job does not pay them. Not
    the template's own modules nor a user's (outside the installed prefixes): those may change
    between two sweeps, the libraries only with an install."""
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    libraries = [
        n
        for n in names
        if str(getattr(sys.modules.get(n), "__file__", None) or "").startswith(prefixes)
        and not n.startswith(("hydra_ddp", "__main__"))
    ]
    with contextlib.suppress(OSError):
        Path(path).write_text("\n".join(libraries))


def _import_quietly(names: list[str]) -> None:
    """What a job imported, imported here too; a module that fails to import is left out."""
    for name in names:
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _serve() -> None:
    """The warm parent: import once, then fork a child per request; report each exit."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import hydra_ddp.train  # noqa: F401  (Hydra, OmegaConf, the template: the cost saved)
    from hydra_plugins.hydra_ddp_ray_launcher import _job  # noqa: F401

    # Ctrl-C in a terminal reaches the Ray workers' group; the task decides what stops a job.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The lines to the task on a descriptor of their own; what a job prints goes where the
    # task's own output goes (the Ray worker's log), as from a process the task started.
    protocol = os.dup(1)
    os.dup2(2, 1)
    reply = os.fdopen(protocol, "w", buffering=1)
    reply.write("ready\n")
    children: dict[int, Path] = {}  # pid -> where it lists the libraries it imported
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.2)
        if ready:
            line = sys.stdin.readline()
            if not line:  # the task's worker is gone: so is this parent (its children are
                break  # in sessions of their own; the task's end kills them)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(request, protocol)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            children[pid] = Path(request["result"] + _IMPORTED)
            reply.write(f"pid {pid}\n")
        for pid, imported in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del children[pid]
                # Read before the task hears of the exit (it then removes the job's files).
                names = imported.read_text().split() if imported.is_file() else []
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                reply.write(f"exit {pid} {code}\n")
                _import_quietly(names)


if __name__ == "__main__":
    _serve()
