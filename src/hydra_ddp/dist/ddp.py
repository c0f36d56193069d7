"""Wrapping the model in DistributedDataParallel as the ddp/ config group says."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hydra_ddp.config import DDPConfig, Wrapper
from hydra_ddp.dist import DistEnv, comm_hooks
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def wrap_model(
    model: torch.nn.Module,
    env: DistEnv,
    cfg: DDPConfig,
    also: Iterable[torch.nn.Module] = (),
    compile_units: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """Move the model to this rank's device and wrap it as the ddp/ config says: in DDP, or
    sharded by fully_shard (ddp=fsdp2, hydra_ddp/dist/fsdp.py; `also` are sharded the same way and
    `compile_units` compiles each unit first). Also return the comm hook (ddp.comm_hook,
    dist/comm_hooks.py) when it has a checkpointable state (state_dict), else None.

    device_ids is [local_rank]'s device, never the global rank: on a second node global rank 8
    would name a GPU that does not exist.
    """
    if cfg.wrapper == Wrapper.fsdp2:
        from hydra_ddp.dist import fsdp

        return fsdp.wrap(model, env, cfg, also, compile_units), None
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
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (same per-forward meaning;
    # the sync at construction is init_sync's job); older releases know only the old name.
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
    hook = comm_hooks.built(
        cfg.comm_hook, cfg.powersgd_rank, cfg.powersgd_start_iter, env.device
    )
    name = comm_hooks.register(hook, ddp)
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
