"""Wrapping the model as the ddp/ config group says, and keeping its buffers (BatchNorm's
running statistics) the same on every rank where that matters: no wrapper averages them, so
after a step the ranks' copies differ, and an evaluation or a checkpoint would see an arbitrary
rank's. `sync_buffers` gives every rank rank 0's before each evaluation and save.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hydra_ddp.config import DDPConfig, Wrapper
from hydra_ddp.distributed import DistEnv, comm_hooks
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def wrap_model(
    model: torch.nn.Module,
    env: DistEnv,
    cfg: DDPConfig,
    also: Iterable[torch.nn.Module] = (),
    compile_units: bool = False,
    autocast: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """Move the model to this rank's device and wrap it: in DDP, or sharded by fully_shard
    (ddp=fsdp2; `also` the same way). Also return the comm hook when it has a state_dict.
    device_ids is the local rank's device: global rank 8 names no GPU on a second node.
    """
    if cfg.sync_batchnorm:
        _to_sync_batchnorm([model, *also], env)
    if cfg.wrapper == Wrapper.fsdp2:
        from hydra_ddp.distributed import fsdp

        return fsdp.wrap(model, env, cfg, also, compile_units, autocast), None
    model = model.to(env.device)
    if not cfg.enabled:
        if env.world_size > 1:
            raise UserError(
                f"ddp=none (ddp.enabled=false) with {env.world_size} processes would "
                "let every rank train its own diverging copy: use ddp=default, or "
                "run one process"
            )
        return model, None
    if not env.distributed:
        return model, None
    on_cuda = env.device.type == "cuda"
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers; older releases have only it.
    buffers_kw = (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        else "broadcast_buffers"
    )
    ddp = DDP(
        model,
        device_ids=[env.device.index] if on_cuda else None,
        output_device=env.device.index if on_cuda else None,
        **{buffers_kw: cfg.broadcast_buffers},
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        init_sync=cfg.init_sync,
    )
    hook = comm_hooks.build_comm_hook(
        cfg.comm_hook, cfg.powersgd_rank, cfg.powersgd_start_iter, env.device
    )
    name = comm_hooks.register_comm_hook(hook, ddp)
    # Read back from the wrapper, not echoed from the config: what DDP actually does.
    log.info(
        "DDP: static_graph=%s find_unused_parameters=%s gradient_as_bucket_view=%s "
        "bucket_cap_mb=%g comm_hook=%s",
        ddp.static_graph,
        ddp.find_unused_parameters,
        ddp.gradient_as_bucket_view,
        ddp.bucket_bytes_cap / 2**20,
        name,
    )
    return ddp, hook if callable(getattr(hook, "state_dict", None)) else None


def _to_sync_batchnorm(modules: list[torch.nn.Module], env: DistEnv) -> None:
    """ddp.sync_batchnorm: every BatchNorm layer as a SyncBatchNorm (same state_dict keys),
    refused in one line on CPU, where torch's raises at its first training forward."""
    if env.world_size > 1 and env.device.type == "cpu":
        raise UserError(
            "ddp.sync_batchnorm=true: torch's SyncBatchNorm runs on GPUs only, and this job "
            "runs on CPU: drop ddp.sync_batchnorm (rank 0's statistics are still broadcast "
            "before each evaluation and save)"
        )
    for module in modules:
        torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    norms = sum(isinstance(m, torch.nn.SyncBatchNorm) for m in modules[0].modules())
    if not norms:
        log.warning("ddp.sync_batchnorm=true, but %s has no BatchNorm layer below its root",
                    type(modules[0]).__name__)  # fmt: skip
    log.info("ddp.sync_batchnorm: %d BatchNorm layer(s) synchronised over the ranks", norms)


@torch.no_grad()
def sync_buffers(modules: Iterable[torch.nn.Module], env: DistEnv) -> None:
    """`# collective`: rank 0's buffers on every rank, in place; a replicated DTensor buffer
    within its mesh, a sharded one (each rank's own part) left alone."""
    if not env.distributed:
        return
    from torch.distributed.tensor import DTensor, Replicate

    for module in modules:
        for buffer in module.buffers():
            if not isinstance(buffer, DTensor):
                dist.broadcast(buffer, src=0)
            elif all(isinstance(p, Replicate) for p in buffer.placements):
                group = buffer.device_mesh.get_group() if buffer.device_mesh.ndim == 1 else None
                if group is not None:
                    dist.broadcast(buffer.to_local(), group=group, group_src=0)
