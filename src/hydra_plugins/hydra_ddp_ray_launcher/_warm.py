"""Warm job starts: a process per node that has imported torch, Hydra and the template once,
and forks one child per job.

A job of a sweep is short; importing torch, Hydra and the project in a fresh interpreter costs
seconds on a small machine, which Hydra's basic launcher pays once per sweep and a process per
job would pay every time. So each node runs a warm server (one per OpenMP thread count: the
count is fixed when a library loads), and each job runs in a child forked from it: the imports
are done, and the child starts from the same untouched state every time (the server never runs
a job), so nothing one job sets (a global, a seed, a signal handler, a cache) reaches the next.
After each job the server also imports the installed libraries that job loaded as it ran (a
data set's scikit-learn, torch's lazily loaded parts; never the template's or a user's
modules), so the next job does not pay them either.

The server outlives the sweep: a detached Ray actor (`Keeper`) holds it for as long as the Ray
cluster runs, so the next sweep on a joined cluster (`hydra.launcher.address=auto`) starts its
first job warm too. It ends after `warm_idle_s` without a job, with its keeper (a sweep-started
Ray takes both with it at the end). It answers `stale` and is started again when the template's
code or the installed packages changed since it imported them (`fingerprint`), so a job never
runs yesterday's code.

What a fresh `python -m` process would have, the child sets before the job runs: its own
session (its ranks are its process group, which the task clears at the end), the job's
environment (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, PYTHONPATH, ...), working dir and
`sys.path[0]`, fresh Python and numpy seeds. The server imports no CUDA, so each child's
CUDA_VISIBLE_DEVICES counts.

The protocol, over the server's Unix socket, one line each way: the task sends `{"spec":…,
"result":…, "env":…, "cwd":…}` as JSON; the server answers `pid <n>` for the child it forked
(or `stale`), then `exit <n> <status>` when it ends (status as `subprocess` gives it: -signal
when killed). A task that hangs up before its job ended (its worker died) has the job sent
SIGTERM: it saves a checkpoint and stops, as under a scheduler's SIGTERM.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import json
import os
import select
import signal
import site
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

# Beside a job's result file: the libraries it imported (`_tell_imported`).
_IMPORTED = ".imported"
# The server's exit status when its imports are out of date: its keeper starts it again.
_STALE = 3


def fingerprint() -> str:
    """What a warm server imported: the template's sources (name, size, mtime) and the state of
    the installed packages (each site-packages dir changes on a pip install). A server whose
    fingerprint no longer matches is replaced, so a job never runs yesterday's code, nor misses
    a package installed since."""
    import hydra_ddp
    import hydra_plugins.hydra_ddp_ray_launcher as plugin

    parts = []
    for root in (Path(hydra_ddp.__file__).parent, Path(plugin.__file__).parent):
        for p in sorted(root.rglob("*.py")):
            with contextlib.suppress(OSError):  # an editor's lock file, a file just removed
                st = p.stat()
                parts.append(f"{p}:{st.st_size}:{st.st_mtime_ns}")
    for d in [*site.getsitepackages(), site.getusersitepackages()]:
        with contextlib.suppress(OSError):
            parts.append(f"{d}:{os.stat(d).st_mtime_ns}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def socket_path(node_id: str, threads: int) -> Optional[str]:
    """Where the warm server of this node and thread count listens: in a dir only this user
    can enter (a request names a pickle to load). None where no such dir can be had."""
    base = tempfile.gettempdir()
    if len(base) > 60:  # a Unix socket's path is at most 107 bytes
        base = "/tmp"
    folder = os.path.join(base, f"hydra-ddp-warm-{os.getuid()}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return os.path.join(folder, f"{node_id[:16]}-{threads}.sock")


class Keeper:
    """A detached Ray actor (no CPUs) that keeps one warm server running on its node; made by
    the sweep (_sweep.Session.keep_warm_servers), found again by the next sweep under its name.

    It writes its pid beside the socket, so a task waiting for the server (still importing)
    knows there is one to wait for. The server is its child and ends when the keeper does (its
    stdin closes); the keeper ends when the server does (idle, or failed). A server that went
    stale is replaced at once; it finishes the jobs it runs, then ends."""

    def __init__(self, node_id: str, threads: int, idle_s: float) -> None:
        self.server: Optional[subprocess.Popen] = None
        path = socket_path(node_id, threads)
        if path is None:  # no private dir for the socket: the tasks start fresh interpreters
            return
        self.path = path
        _remove_dead(Path(path).parent)
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env["OMP_NUM_THREADS"] = str(threads)
        Path(path + ".keeper").write_text(str(os.getpid()))
        cmd = [sys.executable, "-m", __name__, path, str(idle_s)]
        threading.Thread(target=self._keep, args=(cmd, env), daemon=True).start()

    def ready(self) -> bool:
        """Whether this keeper's server runs (or is importing); a sweep that finds it counts
        as a use, so it does not end idle just as that sweep's jobs come."""
        if self.server is None:  # starting, or no socket dir (its tasks start cold)
            return True
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
            s.connect(self.path)
        return self.server.poll() is None

    def _keep(self, cmd: list[str], env: dict[str, str]) -> None:
        replaced = []  # stale servers finishing their jobs: their stdin must stay open
        while True:
            pipe = subprocess.PIPE
            self.server = subprocess.Popen(cmd, stdin=pipe, stdout=pipe, env=env)
            if self.server.stdout.readline().strip() != b"stale":
                break
            replaced.append(self.server)
        self.server.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path + ".keeper")
        os._exit(0)  # a detached actor that ends frees its name for the next sweep's keeper


def _remove_dead(folder: Path) -> None:
    """The files of keepers that were killed (a Ray stopped at the end of its sweep, or by
    `ray stop`): each Ray start names its node anew, so they would pile up."""
    for pid_file in folder.glob("*.keeper"):
        if not _keeper_alive(str(pid_file)[: -len(".keeper")]):
            for dead in (pid_file, pid_file.with_suffix(""), pid_file.with_suffix(".new")):
                dead.unlink(missing_ok=True)


def start(path: str, request: dict[str, Any], wait_s: float) -> Optional[Child]:
    """Fork the job on the node's warm server, waiting up to `wait_s` for one that is still
    importing. None when there is none to wait for (the caller starts a fresh interpreter)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
        except OSError:
            conn.close()
            if not _keeper_alive(path):
                return None
            time.sleep(0.1)
            continue
        conn.sendall((json.dumps(request) + "\n").encode())
        child = Child(conn)
        reply = child.line(deadline)
        if reply is not None and reply.startswith("pid "):
            child.pid = int(reply.split()[1])
            return child
        conn.close()  # `stale` (its keeper starts a new one) or gone: try the next
    return None


def _keeper_alive(path: str) -> bool:
    try:
        os.kill(int(Path(path + ".keeper").read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


class Child:
    """A forked job, as the task handles a `subprocess.Popen` of one (the same calls)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.pid = 0
        self.returncode: Optional[int] = None
        self._buffer = b""

    def poll(self) -> Optional[int]:
        return self._wait(0.0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._wait(1e9 if timeout is None else timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"job pid {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _wait(self, timeout: float) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            line = self.line(deadline)
            if line is None:
                if self._buffer is None:  # the server is gone: its exit report with it
                    self.returncode = -signal.SIGKILL
                break
            if line.startswith(f"exit {self.pid} "):
                self.returncode = int(line.split()[2])
                self.conn.close()
        return self.returncode

    def line(self, deadline: float) -> Optional[str]:
        """The server's next line, or None when none came by `deadline` (or it hung up)."""
        while self._buffer is not None and b"\n" not in self._buffer:
            wait = max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], wait)[0]:
                return None
            data = self.conn.recv(4096)
            self._buffer = self._buffer + data if data else None
        if self._buffer is None:
            return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()


def _child(request: dict[str, Any]) -> int:
    """In the forked child: become what a fresh process of the job would be, run the job."""
    import random

    import numpy
    import torch

    from hydra_plugins.hydra_ddp_ray_launcher import _job

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # where `python -m` would look first
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    sys.path[1:1] = [p for p in paths if p and p not in sys.path]
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
    lazily loaded parts): the server imports them too, so the next job does not pay them. Not
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


class _Server:
    """The warm server's state: its socket, the tasks connected to it, the jobs it forked."""

    def __init__(self, path: str, keeper: Any) -> None:
        self.path = path
        self.keeper = keeper  # a line to the keeper: `stale` when this server is replaced
        self.print = fingerprint()
        self.conns: dict[socket.socket, Optional[bytes]] = {}  # None: its job was forked
        self.children: dict[int, tuple[socket.socket, Path]] = {}  # pid -> (task, .imported)
        # SIGCHLD wakes the select loop: a job's end is reported at once, not at the next poll.
        self.wake_r, wake_w = os.pipe()
        for fd in (self.wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # Ctrl-C in a terminal reaches the Ray workers' group; the task decides what stops a job.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # SIGTERM ends it through `close`: its socket removed, its jobs told to stop.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        self.listener: Optional[socket.socket] = socket.socket(socket.AF_UNIX)
        # Bound under another name, then renamed: a task connects only once the server listens.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".new")
        self.listener.bind(path + ".new")
        self.listener.listen(64)
        os.rename(path + ".new", path)

    def serve(self, idle_s: float) -> int:
        idle_since = time.monotonic()
        while self.listener is not None or self.children:
            wait = max(0.0, idle_s - (time.monotonic() - idle_since))
            ready = select.select([sys.stdin, self.wake_r, *self._sockets()], [], [], wait)[0]
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
                return 0  # the keeper is gone
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            if self.listener is not None and self.listener in ready:
                self.conns[self.listener.accept()[0]] = b""
            for conn in [c for c in ready if c in self.conns]:
                self._read(conn)
            self._reap()
            if self.conns or self.children:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= idle_s:
                return 0
        return _STALE  # replaced, and its last job ended

    def _sockets(self) -> list[socket.socket]:
        return [*self.conns] + ([self.listener] if self.listener is not None else [])

    def _read(self, conn: socket.socket) -> None:
        data = conn.recv(65536)
        if not data:  # the task hung up: its job, if running, stops as its worker would have it
            del self.conns[conn]
            for pid, (task, _) in self.children.items():
                if task is conn:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
            conn.close()
            return
        if self.conns[conn] is None:
            return
        self.conns[conn] += data
        if b"\n" not in self.conns[conn]:
            return
        request = json.loads(self.conns[conn].split(b"\n", 1)[0])
        self.conns[conn] = None
        if self.listener is None or fingerprint() != self.print:
            self._stale()
            conn.sendall(b"stale\n")
            return
        # What the server imported, frozen before the fork: the job's garbage collections then
        # skip those objects (a few hundred thousand: torch, Hydra, the libraries jobs loaded)
        # instead of walking them, and copying their pages, again and again as it trains.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            self._as_child(request)
        self.children[pid] = (conn, Path(request["result"] + _IMPORTED))
        conn.sendall(f"pid {pid}\n".encode())

    def _stale(self) -> None:
        """The template or the packages changed since this server imported them: stop taking
        jobs, and have the keeper start a new server while this one finishes the running ones."""
        if self.listener is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self.listener.close()
        self.listener = None
        self.keeper.write("stale\n")
        self.keeper.flush()

    def _as_child(self, request: dict[str, Any]) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sock in self._sockets():
                sock.close()
            os.close(self.wake_r)
            self.keeper.close()
            code = _child(request)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        for pid, (conn, imported) in list(self.children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            del self.children[pid]
            # Read before the task hears of the exit (it then removes the job's files).
            names = imported.read_text().split() if imported.is_file() else []
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            if conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {pid} {code}\n".encode())
            _import_quietly(names)

    def close(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        for pid in self.children:  # in sessions of their own: ended as their tasks would
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def _serve(path: str, idle_s: float) -> int:
    """The warm server: import once, then fork a child per request; report each exit."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    # The cost saved: Hydra, the template, and the job's modules train.py imports in `train`.
    import hydra_ddp.launch.runner  # noqa: F401
    import hydra_ddp.loop.checkpointing  # noqa: F401
    import hydra_ddp.loop.fit  # noqa: F401
    import hydra_ddp.loop.prepare  # noqa: F401
    import hydra_ddp.loop.wrapping  # noqa: F401
    import hydra_ddp.train  # noqa: F401
    from hydra_plugins.hydra_ddp_ray_launcher import _job  # noqa: F401

    # Its stdout is the line to the keeper; what a job prints goes where the keeper's output
    # goes (the Ray worker's log).
    keeper = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    server = _Server(path, keeper)
    try:
        return server.serve(idle_s)
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], float(sys.argv[2])))
