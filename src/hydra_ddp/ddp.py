"""Wrapping the model in DistributedDataParallel as the ddp/ config group says, and turning
DDP's own failure messages into one line that says what to change."""

from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hydra_ddp.config import CommHook, DDPConfig
from hydra_ddp.dist import DistEnv
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def wrap_model(model: torch.nn.Module, env: DistEnv, cfg: DDPConfig) -> torch.nn.Module:
    """Move the model to this rank's device and wrap it in DDP as the ddp/ config says.

    device_ids is [local_rank]'s device, never the global rank: on a second node global rank 8
    would name a GPU that does not exist.
    """
    model = model.to(env.device)
    if not cfg.enabled:
        if env.world_size > 1:
            raise UserError(
                f"ddp=none (ddp.enabled=false) with {env.world_size} processes would "
                "let every rank train its own diverging copy: use ddp=default, or "
                "run one process"
            )
        return model
    if not env.distributed:
        return model
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
    hook = _register_comm_hook(ddp, cfg)
    # Read back from the wrapper, not echoed from the config: what DDP actually does.
    log.info(
        "DDP: static_graph=%s find_unused_parameters=%s gradient_as_bucket_view=%s "
        "bucket_cap_mb=%g comm_hook=%s",
        ddp.static_graph,
        ddp.find_unused_parameters,
        ddp.gradient_as_bucket_view,
        ddp.bucket_bytes_cap / 2**20,
        hook,
    )
    return ddp


def _register_comm_hook(ddp: DDP, cfg: DDPConfig) -> str:
    """Register the configured gradient-compression hook; return its name ("none" if none)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if cfg.comm_hook == CommHook.bf16_compress and dist.get_backend() != "nccl":
        raise UserError(
            "ddp=bf16_compress (ddp.comm_hook=bf16_compress) needs CUDA with NCCL "
            f">= 2.10, but this job runs the {dist.get_backend()} backend: use "
            "ddp=fp16_compress or ddp=powersgd there"
        )
    state, hook = None, None
    if cfg.comm_hook == CommHook.fp16_compress:
        hook = default_hooks.fp16_compress_hook
    elif cfg.comm_hook == CommHook.bf16_compress:
        hook = default_hooks.bf16_compress_hook
    elif cfg.comm_hook == CommHook.powersgd:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_iter,
        )
        hook = powerSGD_hook.powerSGD_hook
    if hook is None:
        return "none"
    ddp.register_comm_hook(state, hook)
    return hook.__name__


def explain(e: BaseException) -> UserError | None:
    """A one-line UserError for a failure whose torch message is a paragraph, else None.

    Called on the error path only, never per step."""
    # DDP's own message for this case is a paragraph about reductions and buckets.
    if isinstance(e, RuntimeError) and "Expected to have finished reduction" in str(e):
        return UserError(
            "some model parameters got no gradient in a step and DDP was not told "
            "to expect that: use ddp=unused_params (sets "
            "ddp.find_unused_parameters=true), or make every parameter take part "
            "in the loss"
        )
    return None
