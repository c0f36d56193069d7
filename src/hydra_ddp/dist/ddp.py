"""Wrapping the model in DistributedDataParallel as the ddp/ config group says."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hydra_ddp.config import CommHook, DDPConfig, Wrapper
from hydra_ddp.dist import DistEnv
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def wrap_model(
    model: torch.nn.Module,
    env: DistEnv,
    cfg: DDPConfig,
    also: Iterable[torch.nn.Module] = (),
    compile_units: bool = False,
) -> tuple[torch.nn.Module, CommHookState | None]:
    """Move the model to this rank's device and wrap it as the ddp/ config says: in DDP, or
    sharded by fully_shard (ddp=fsdp2, hydra_ddp/dist/fsdp.py; `also` are sharded the same way and
    `compile_units` compiles each unit first). Also return the comm hook's checkpointable
    state (PowerSGD's), if it has one.

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
    hook, state = _register_comm_hook(ddp, cfg)
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
    return ddp, None if state is None else CommHookState(state, env.device)


def _register_comm_hook(ddp: DDP, cfg: DDPConfig) -> tuple[str, Any]:
    """Register the configured gradient-compression hook; return its name ("none" if none)
    and its state object (None for the stateless hooks)."""
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
        return "none", None
    ddp.register_comm_hook(state, hook)
    return hook.__name__, state


class CommHookState:
    """PowerSGD's state as a checkpoint member: its step count (so a resume does not redo the
    warm-up of `ddp.powersgd_start_iter` plain all-reduce steps), this rank's error feedback and
    warm-start factors (per rank: the checkpointer gathers them), and its random generator.
    Only tensors and numbers, so `torch.load(weights_only=True)` reads it back."""

    _TENSOR_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")

    def __init__(self, state: Any, device: torch.device) -> None:
        self.state, self.device = state, device

    def state_dict(self) -> dict[str, Any]:
        state = self.state
        kind, keys, pos, has_gauss, gauss = state.rng.get_state()
        saved = {name: dict(getattr(state, name)) for name in self._TENSOR_DICTS}
        return {
            **saved,
            "iter": state.iter,
            "rank": state.matrix_approximation_rank,
            "rng": [torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.state
        state.iter = int(saved["iter"])
        state.error_dict = {k: _to(v, self.device) for k, v in saved["error_dict"].items()}
        if int(saved["rank"]) == state.matrix_approximation_rank:  # else P and Q change shape
            for name in ("p_memory_dict", "q_memory_dict"):
                setattr(state, name, {k: _to(v, self.device) for k, v in saved[name].items()})
        keys, pos, has_gauss, gauss = saved["rng"]
        state.rng.set_state(("MT19937", keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if torch.is_tensor(value) else value
