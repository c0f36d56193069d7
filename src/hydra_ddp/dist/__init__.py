"""The distributed environment: the only module that reads RANK, LOCAL_RANK and WORLD_SIZE.

A `DistEnv` is built once per process from what the launcher (torchrun, torch's elastic agent,
SLURM through submitit) put in the environment, and passed explicitly to everything else. With
none of those variables set the job runs as one process with no process group at all.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import logging
import os
import socket
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hydra_ddp.config import Backend, Device, DistConfig
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Cheap to build; no process group needed."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    # A launcher (torchrun, the elastic agent, SLURM) started this process: it gets a process
    # group and a DDP wrap even when it is the only rank, so one GPU runs the same code as 64.
    launched: bool = False

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is up (init_process_group ran)."""
        return dist.is_available() and dist.is_initialized()


def under_launcher() -> bool:
    """True when torchrun, torch's elastic agent or SLURM/submitit started this process."""
    return "RANK" in os.environ or _submitit_tasks() > 1


def export_submitit_env() -> None:
    """Inside a submitit task with several tasks, export RANK/WORLD_SIZE/... the way torchrun
    does, from SLURM's variables (or submitit's local ones), so the rest of the code sees one
    kind of environment."""
    if "RANK" in os.environ or _submitit_tasks() <= 1:
        return
    from submitit.helpers import TorchDistributedEnvironment

    # A MASTER_ADDR / MASTER_PORT the user (or a site's script) set is respected: submitit's
    # export would refuse to run with them set ("Cannot export ... is already set").
    given = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    # Keep every GPU visible: the device is picked from LOCAL_RANK, as under torchrun.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    os.environ.update(given)


def share_cpus_in_submitit_task(cpus_per_task: int | None) -> int | None:
    """Inside a submitit task (one rank) whose OMP_NUM_THREADS nobody set: give its OpenMP pool
    its CPU share, as torchrun does for its workers (SLURM's cpus-per-task, else the
    launcher's `cpus_per_task`, else the machine's cores over the job's tasks). Full pools in
    every task of jobs that the local executor starts side by side fight over the cores (2
    jobs x 2 tasks on 2 cores: 30x slower steps). Returns the threads set, or None."""
    if "SUBMITIT_EXECUTOR" not in os.environ or "OMP_NUM_THREADS" in os.environ:
        return None
    share = int(os.environ.get("SLURM_CPUS_PER_TASK") or cpus_per_task or 0)
    if share < 1:
        share = max(1, (os.cpu_count() or 1) // max(1, _submitit_tasks()))
    os.environ["OMP_NUM_THREADS"] = str(share)  # for the processes it starts (data workers)
    torch.set_num_threads(share)
    return share


def _submitit_tasks() -> int:
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return 0
    try:
        from submitit import JobEnvironment

        return JobEnvironment().num_tasks
    except Exception:  # not inside a submitit job after all
        return 0


def env_from_environ(cfg: DistConfig) -> DistEnv:
    """Read the launcher's variables and pick this rank's device."""
    present = [k for k in _LAUNCHER_VARS if k in os.environ]
    if not present:
        return DistEnv(device=_pick_device(cfg, local_rank=0))
    missing = [k for k in _LAUNCHER_VARS if k not in os.environ]
    if missing:
        raise UserError(
            f"the environment sets {', '.join(present)} but not {', '.join(missing)}: start the "
            "job with torchrun (or set all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
            "MASTER_PORT)"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        device=_pick_device(cfg, local_rank),
        launched=True,
    )


def _pick_device(cfg: DistConfig, local_rank: int) -> torch.device:
    want_cuda = cfg.device == Device.cuda or (
        cfg.device == Device.auto and torch.cuda.is_available()
    )
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(
            "dist.device=cuda but CUDA is not available here: use dist.device=cpu or auto"
        )
    count = torch.cuda.device_count()
    if count == 1 and local_rank > 0 and _one_gpu_per_task():
        # SLURM's --gpus-per-task=1 (or a binding script) shows each task only its own GPU.
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise UserError(
            f"local rank {local_rank} has no GPU: this node has {count} visible GPU(s) but more "
            "processes per node were started; set --nproc_per_node (or dist.nproc_per_node) to "
            f"at most {count}, or use dist.device=cpu"
        )
    return torch.device("cuda", local_rank)


def _one_gpu_per_task() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) == 1


def backend_for(cfg: DistConfig, device: torch.device) -> str:
    if cfg.backend == Backend.auto:
        return "nccl" if device.type == "cuda" else "gloo"
    if cfg.backend == Backend.nccl and device.type != "cuda":
        raise UserError(
            "dist.backend=nccl needs CUDA devices but this rank runs on cpu: use "
            "dist.backend=gloo (or auto)"
        )
    return cfg.backend.value


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


# --------------------------------------------------------------------------------------------
# The collectives the loop uses: each a no-op (or the identity) without a process group
# --------------------------------------------------------------------------------------------


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few numbers over all ranks (float64, so counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    if env.distributed:
        dist.all_reduce(t)
    return t.tolist()


def all_gather_floats(values: list[float], env: DistEnv) -> list[list[float]]:
    """Every rank's `values` (same length on all ranks), indexed by rank."""
    if not env.distributed:
        return [list(map(float, values))]
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    out = [torch.zeros_like(t) for _ in range(env.world_size)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def all_gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's picklable `obj`, indexed by rank."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its own slice, summed over
    the ranks' losses (each rank's loss used every slice)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(ctx.world)]
        dist.all_gather(parts, tensor.contiguous(), group=group)  # collective
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Rank r's loss depends on every slice: the gradient of slice k is the sum over ranks
        # of their gradients for it. An all-reduce (gloo has no reduce-scatter on CPU), then
        # this rank's slice.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # collective
        return grad.chunk(ctx.world)[ctx.rank], None


def all_gather_with_grad(
    tensor: torch.Tensor, group: Any = None, check_shapes: bool = True
) -> torch.Tensor:
    """Collective: every rank's `tensor` concatenated along dim 0 in rank order, differentiable:
    gradients flow back to each rank's own slice (the sum of every rank's gradient for it, so
    with DDP's average the step is the gradient of the mean of the ranks' losses). Without a
    process group: the tensor itself. A contrastive loss's negatives from every rank:
    hydra_ddp/examples/contrastive.py.

    Every rank must pass a tensor of the same shape: training batches are (strided sampling
    pads every rank to the same count), evaluation shards are not (ranks hold one row more or
    less, and a different number of batches), so a loss gathers only when `model.training`.
    `check_shapes` agrees the shapes first (one small collective and a host sync per call) and
    raises one line naming them on every rank, where gloo would abort a rank with its error on
    stderr only; False skips that.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    if check_shapes:
        _same_shapes(tensor, group)  # collective
    return _AllGatherWithGrad.apply(tensor, group)


def _same_shapes(tensor: torch.Tensor, group: Any) -> None:
    world = dist.get_world_size(group)
    # The number of dimensions first: shapes of different lengths cannot be gathered as one.
    shape = torch.tensor([tensor.dim(), *tensor.shape, *[-1] * (8 - tensor.dim())][:9],
                         device=tensor.device)  # fmt: skip
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)  # collective
    seen = [tuple(s[1 : 1 + int(s[0])].tolist()) for s in shapes]
    if len(set(seen)) > 1:
        raise UserError(
            "all_gather_with_grad: the ranks hold tensors of different shapes ("
            + ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(seen))
            + "); every rank must gather the same shape: gather in training only (if "
            "model.training), where every rank's batch has the same size"
        )


def sum_by_name(sums: dict[str, list[float]], env: DistEnv) -> dict[str, list[float]]:
    """Element-wise sums over ranks of named lists; a name some ranks lack counts as zeros."""
    merged: dict[str, list[float]] = {}
    for part in all_gather_objects(sums, env):
        for name, values in part.items():
            merged[name] = (
                [a + b for a, b in zip(merged[name], values)] if name in merged else list(values)
            )
    return merged


def barrier(env: DistEnv) -> None:
    """Wait for every rank. Also run on the success path before teardown: torch 2.13's gloo can
    abort at exit when a rank tears its group down right after the last collective (~1 in 3
    plain scripts here, none with a barrier first)."""
    if env.distributed:
        dist.barrier()


def launcher_rank() -> int:
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    if "SUBMITIT_LOCAL_GLOBALID" in os.environ:
        return int(os.environ["SUBMITIT_LOCAL_GLOBALID"])
    return 0
