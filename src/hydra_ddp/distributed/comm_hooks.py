"""DDP communication hooks, chosen by `ddp.comm_hook`: a `_target_` and its arguments, or a
built-in's name (`ddp.comm_hook=powersgd`). A hook of yours meets `hydra_ddp.protocols.CommHook`
or is a plain function `(state, bucket) -> Future`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from hydra_ddp.components import build
from hydra_ddp.config import COMM_HOOKS
from hydra_ddp.errors import UserError, check


class CommHook:
    """The base of a hook (the contract: `hydra_ddp.protocols.CommHook`): `hook(state,
    bucket)` and its `state`, registered on the DDP wrap (`register_comm_hook`)."""

    state: Any = None

    @property
    def name(self) -> str:
        """What the DDP log line says: the hook function's name, else the class's."""
        fn = self.__dict__.get("hook")
        return getattr(fn, "__name__", None) or type(self).__qualname__

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__qualname__} must define hook(state, bucket)")


class FP16Compress(CommHook):
    """All-reduce gradients in float16: half the bytes on the wire, small precision loss."""

    def __init__(self) -> None:
        self.hook = default_hooks.fp16_compress_hook  # type: ignore[method-assign]


class BF16Compress(CommHook):
    """All-reduce gradients in bfloat16 (NCCL >= 2.10): half the bytes, float32's range."""

    def __init__(self) -> None:
        self.hook = default_hooks.bf16_compress_hook  # type: ignore[method-assign]

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        if dist.get_backend() != "nccl":
            raise UserError(
                "ddp=bf16_compress (ddp.comm_hook=bf16_compress) needs CUDA with NCCL "
                f">= 2.10, but this job runs the {dist.get_backend()} backend: use "
                "ddp=fp16_compress or ddp=powersgd there"
            )
        ddp.register_comm_hook(self.state, self.hook)


class PowerSGD(CommHook):
    """PowerSGD low-rank gradient compression (Vogels et al., 2019), plain all-reduce for the
    first `start_iter` steps. Its state (step count, this rank's error feedback and factors,
    its RNG) is checkpointed per rank as tensors and numbers, for `weights_only=True`."""

    _TENSOR_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")

    def __init__(self, rank: int, start_iter: int, device: Any = "cpu") -> None:
        check(rank >= 1, "rank", ">= 1", rank)
        check(start_iter >= 2, "start_iter", ">= 2 (PowerSGD's error feedback)", start_iter)
        self.device = torch.device(device)
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
        )
        self.hook = powerSGD_hook.powerSGD_hook  # type: ignore[method-assign]

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


def build_comm_hook(spec: Any, powersgd_rank: int, powersgd_start_iter: int, device: Any) -> Any:
    """The hook `ddp.comm_hook` names (None for `none`): a built-in's name (PowerSGD then takes
    ddp.powersgd_rank and ddp.powersgd_start_iter), or a component built with `device` offered."""
    if isinstance(spec, str):
        if spec == "none":
            return None
        spec = {"_target_": f"{__name__}.{COMM_HOOKS[spec]}"}  # config.COMM_HOOKS: the built-ins
        if spec["_target_"].endswith("PowerSGD"):
            spec.update(rank=powersgd_rank, start_iter=powersgd_start_iter)
    hook = build(spec, "ddp.comm_hook", _as_function=True, device=device)
    if not callable(getattr(hook, "hook", hook)):  # a plain function is a stateless hook
        raise UserError(
            f"ddp.comm_hook._target_={spec['_target_']} built a {type(hook).__qualname__} "
            "without hook(state, bucket): give a function (state, bucket) -> Future or a class "
            "with hook(state, bucket) (hydra_ddp.protocols.CommHook)"
        )
    return hook


def register_comm_hook(hook: Any, ddp: torch.nn.parallel.DistributedDataParallel) -> str:
    """Register `hook` on the DDP wrap; its name for the log ("none" if None)."""
    if hook is None:
        return "none"
    if callable(getattr(hook, "register", None)):
        hook.register(ddp)
    else:
        ddp.register_comm_hook(getattr(hook, "state", None), getattr(hook, "hook", hook))
    return getattr(hook, "name", None) or getattr(hook, "__name__", type(hook).__qualname__)


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if torch.is_tensor(value) else value
