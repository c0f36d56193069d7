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

from hydra_ddp.config import Backend, DistConfig
from hydra_ddp.distributed.env import DistEnv
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def init_process_group(env: DistEnv, cfg: DistConfig) -> None:
    """Start the process group when a launcher started this process, the device set first so
    that NCCL binds each rank to its own GPU, not every rank to GPU 0."""
    if not env.launched:
        return
    use_device(env)
    backend = cfg.backend.value
    if cfg.backend == Backend.auto:
        backend = "nccl" if env.device.type == "cuda" else "gloo"
    elif cfg.backend == Backend.nccl and env.device.type != "cuda":
        raise UserError(
            "dist.backend=nccl needs CUDA devices but this rank runs on cpu: use "
            "dist.backend=gloo (or auto)"
        )
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    kwargs: dict = {"device_id": env.device} if env.device.type == "cuda" else {}
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        # A MASTER_ADDR that names no host would make every rank retry for dist.timeout_s and
        # then blame the port: say so at once.
        socket.getaddrinfo(os.environ.get("MASTER_ADDR", ""), None)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(
            f"rank {env.rank}: MASTER_ADDR={os.environ.get('MASTER_ADDR', '')} does not resolve "
            f"to an address ({e}): set it to the head node's host name or IP (under SLURM: the "
            "first of `scontrol show hostnames $SLURM_JOB_NODELIST`)"
        ) from None
    # A client of a port that accepts connections but never answers (another program's
    # listener) waits in torch's store handshake with no timeout: give up from a thread.
    watchdog = threading.Timer(
        cfg.timeout_s + 10.0,
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


def _give_up(message: str) -> None:
    """Fail the whole process from a watchdog thread, with the usual one-line error."""
    log.error("error: %s", message)
    logging.shutdown()
    os._exit(2)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's shared agent store, a store private to this attempt of the worker group:
    every attempt gets the same store and env:// uses the same keys each time, so after a
    restart a rank can read the dead attempt's addresses (pytorch/pytorch#135712)."""
    # Several agents (nodes) do not agree on the restart count, so the prefix would split the
    # group: there the documented TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives a fresh store.
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


@contextlib.contextmanager
def process_group(env: DistEnv, cfg: DistConfig) -> Iterator[None]:
    """The process group's lifetime (none without a launcher), and its teardown order.

    Build the wrapper in a function called inside this block, so it dies with that frame,
    before the group: dropping the group's last reference inside the wrapper's deallocation
    joins gloo's threads with the GIL held, which deadlocks when one still frees a tensor. On
    an error the traceback's frames (holding the wrapper) are cleared first, and a garbage
    collection frees fully_shard's reference cycles (its DTensors hold the group) before the
    group goes."""
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
        if env.distributed:  # without a group, nothing to free before it
            gc.collect()
            dist.destroy_process_group()


def _crash_trace_to_log() -> Any:
    """A rank that dies in a collective (gloo aborts the process, its message on stderr only)
    leaves every thread's Python stack in its own log file: faulthandler into the root
    logger's file, returned (None where the rank has none)."""
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
    """Wait for every rank. Also run before teardown: gloo can abort at exit when a rank tears
    its group down right after the last collective."""
    if env.distributed:
        dist.barrier()
