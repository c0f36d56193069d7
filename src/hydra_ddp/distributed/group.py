"""The process group's life: started from a `DistEnv`, bounded by `dist.timeout_s` while it
starts, torn down cleanly (a rank that dies in a collective leaves its Python stack in its log).
"""

import contextlib
import datetime
import faulthandler
import gc
import logging
import os
import socket
import threading
import traceback
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hydra_ddp.config import DistConfig
from hydra_ddp.distributed.env import DistEnv, backend_for
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def init_process_group(env: DistEnv, cfg: DistConfig) -> None:
    """Start the process group when a launcher started this process. The device is set first
    so NCCL binds each rank to its own GPU rather than every rank to GPU 0."""
    if not env.launched:
        return
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    backend = backend_for(cfg, env.device)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    kwargs: dict = {"device_id": env.device} if env.device.type == "cuda" else {}
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    _check_resolves(os.environ.get("MASTER_ADDR", ""), env.rank)
    # A client of a port that accepts connections but never answers (another program's
    # listener) waits in torch's store handshake with no timeout at all: give up from a
    # thread (the wait releases the GIL), since the waiting call cannot be interrupted.
    watchdog = threading.Timer(
        cfg.timeout_s + _WATCHDOG_MARGIN_S,
        _give_up,
        args=(
            f"rank {env.rank} could not join the process group at {where} within "
            f"dist.timeout_s={cfg.timeout_s:g}s: the port accepts connections but no process "
            "group answers there (another program holds it?); pick a free MASTER_PORT "
            "(torchrun --master-port) or let torchrun choose (--standalone)",
        ),
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        store = _attempt_store(timeout)
        if store is not None:
            kwargs.update(store=store, rank=env.rank, world_size=env.world_size)
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    except RuntimeError as e:  # DistStoreError, DistNetworkError are RuntimeErrors too
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise UserError(
                f"rank {env.rank} cannot host the process group on {where}: port "
                f"{os.environ.get('MASTER_PORT')} is already in use on this machine (another "
                "job?); pick a free MASTER_PORT (torchrun --master-port), or let one be chosen "
                "(torchrun --standalone, or python -m hydra_ddp.train dist.nproc_per_node=N)"
            ) from e
        raise UserError(
            f"rank {env.rank} could not join the process group at {where} within "
            f"dist.timeout_s={cfg.timeout_s:g}s ({str(e).splitlines()[0]}): check that every "
            "rank was started and can reach the master, or raise dist.timeout_s"
        ) from e
    finally:
        watchdog.cancel()
    log.info(
        "process group up: backend=%s rank=%d/%d device=%s rendezvous=%s",
        backend,
        env.rank,
        env.world_size,
        env.device,
        where,  # jobs side by side (a Ray sweep) each have their own
    )


_WATCHDOG_MARGIN_S = 10.0


def _check_resolves(host: str, rank: int) -> None:
    """A MASTER_ADDR that names no host would make every rank retry for dist.timeout_s and then
    blame the port: say so at once."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(
            f"rank {rank}: MASTER_ADDR={host} does not resolve to an address ({e}): set it to "
            "the head node's host name or IP (under SLURM: the first of `scontrol show "
            "hostnames $SLURM_JOB_NODELIST`)"
        ) from None


def _give_up(message: str) -> None:
    """Fail the whole process from a watchdog thread, with the usual one-line error."""
    log.error("error: %s", message)
    logging.shutdown()
    os._exit(2)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's shared agent store, a store private to this attempt of the worker group.

    torchrun (TORCHELASTIC_USE_AGENT_STORE=True) hands every attempt the same store, and
    init_process_group's env:// rendezvous uses the same key names each time, so after
    `--max-restarts` restarts the group a new rank can read the dead attempt's addresses and
    fail to connect (pytorch/pytorch#135712, still so in torch 2.13). A prefix naming the
    attempt keeps each attempt's keys apart.
    """
    # Several agents (nodes) do not agree on the restart count (only the agent whose worker
    # failed counts one), so the prefix would split the group: there the documented
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every attempt a fresh store instead.
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or os.environ.get("GROUP_WORLD_SIZE", "1") != "1"
    ):
        return None
    attempt = "/".join(
        os.environ.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE")
    )
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"hydra_ddp/pg/{attempt}/", client)


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(env: DistEnv, cfg: DistConfig) -> Iterator[None]:
    """The process group's lifetime (none without a launcher), and its teardown order.

    Run the code that builds the DDP wrapper in a function called inside this block, so the
    wrapper dies with that function's frame, before the group. On an error the traceback keeps
    the failed frames (and the wrapper) alive: they are cleared here first. Dropping the group's
    last reference inside the wrapper's deallocation joins gloo's threads with the GIL held,
    which deadlocks when one of them still frees a tensor (seen under load). The same holds
    for fully_shard's state (ddp=fsdp2): its modules and DTensors hold the group through their
    device mesh, and FSDP's hooks make reference cycles, so a garbage collection frees them
    here, before the group, rather than at interpreter exit after it."""
    init_process_group(env, cfg)
    crash_log = _crash_trace_to_log() if env.launched else None
    try:
        yield
    except BaseException as e:
        # The whole chain: a translated error keeps the original (and its frames) as cause.
        seen: set[int] = set()
        chained: BaseException | None = e
        while chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__cause__ or chained.__context__
        raise
    finally:
        if crash_log is not None:
            faulthandler.disable()
        # Without a group (one rank, no launcher) there is nothing to free before it, and a
        # full collection walks every object torch made (0.3 s, each job of a sweep).
        if env.distributed:
            gc.collect()
            destroy_process_group()


def _crash_trace_to_log() -> Any:
    """A rank that dies in a collective (gloo aborts the process when ranks disagree on sizes,
    with its message on stderr only) leaves the Python stack of the call, the line that died,
    in its own log file: faulthandler into the file the root logger writes (every thread's:
    the abort comes from a gloo thread, the collective waits in the main one). Returns that
    file, or None where the rank has no log file."""
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.FileHandler) and stream is not None:
            try:
                faulthandler.enable(file=stream, all_threads=True)
            except (OSError, ValueError, AttributeError):  # no file descriptor
                return None
            return stream
    return None


def use_device(env: DistEnv) -> None:
    """Make this rank's GPU the current one before anything touches CUDA (building the model,
    autocast's bf16 check, NCCL): otherwise every rank opens a context on GPU 0 first."""
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)


def barrier(env: DistEnv) -> None:
    """Wait for every rank. Also run on the success path before teardown: torch 2.13's gloo can
    abort at exit when a rank tears its group down right after the last collective (~1 in 3
    plain scripts here, none with a barrier first)."""
    if env.distributed:
        dist.barrier()
