"""The rules the memory plan (memory.py) counts by where torch allocates beyond the model's
own tensors and the optimizer's: FSDP2's gathered units, PowerSGD's state and the cuBLAS
workspaces of a CUDA job, each from the library's documented behaviour or its source (the
version named where it matters); docs/memory_plan.md lists them."""

from __future__ import annotations

import os
import re

import torch

from hydra_ddp.config import COMM_HOOKS, DType, TrainConfig, Wrapper
from hydra_ddp.tracking.peak import PeakMeter

# torch's pool of CUDA streams a future's callbacks run on: 32 per device and priority, handed
# out in turn (c10/cuda/CUDAStream.h).
_POOL_STREAMS = 32
_HALF = {DType.bf16, DType.fp16}


def gathered_bytes(root: int, units: list[int], cfg: TrainConfig) -> int:
    """The unit-sized buffers fully_shard holds at once on a rank, at the backward's peak, from
    the whole (unsharded) bytes of the root's own parameters and of each other unit's
    (torch/distributed/fsdp/_fully_shard/, 2.13):

    - the root: gathered for the forward and kept so (reshard_after_forward=False in
      distributed/fsdp.py), and its unsharded gradients: the root's backward comes first (the
      head) and its reduce-scatter last, after every unit's: 2 x root;
    - the units, with reshard_after_forward (one gathered at a time), of the largest: the
      unit computing its backward (its gathered parameters and its unsharded gradients, until
      its reduce-scatter copies them into a flat reduce-scatter input), the next unit's flat
      all-gather output (prefetched during this one's backward) and the previous unit's
      reduce-scatter input (kept until this unit's reduce-scatter): 4 x the largest unit from
      the third unit on, 3 with two units, 2 with one;
    - without reshard_after_forward every unit stays gathered from its forward to its
      backward: all of them, plus the computing unit's gradients and the previous unit's
      reduce-scatter input.

    The sharded gradients (the reduce-scatter outputs) are the plan's `grads`. In
    ddp.param_dtype (the gradients too: autograd makes them in the gathered parameters' dtype).
    """
    largest = max(units, default=0)
    if cfg.ddp.reshard_after_forward:
        held = min(len(units) + 1, 4) * largest if units else 0
    else:
        held = sum(units) + min(len(units), 2) * largest
    scale = 0.5 if cfg.ddp.param_dtype in _HALF else 1.0
    return int(scale * (2 * root + held))


def powersgd(cfg: TrainConfig) -> tuple[int, int] | None:
    """(rank, start_iter) where ddp.comm_hook is the template's PowerSGD, else None."""
    hook = cfg.ddp.comm_hook
    if isinstance(hook, str) and COMM_HOOKS.get(hook) == "PowerSGD":
        return cfg.ddp.powersgd_rank, cfg.ddp.powersgd_start_iter
    if isinstance(hook, dict) and str(hook.get("_target_", "")).endswith("comm_hooks.PowerSGD"):
        return int(hook["rank"]), int(hook["start_iter"])
    return None


def powersgd_bytes(parameters: list[torch.Tensor], cfg: TrainConfig) -> int:
    """PowerSGD's state (torch's powerSGD_hook, the template's options): its error feedback, a
    copy of the gradients kept between steps; while the hook runs on a bucket, a copy of the
    bucket and the bucket's new error (2 x the largest bucket, ddp.bucket_cap_mb); and the
    low-rank factors it keeps (warm start) of each gradient it compresses, an n x m matrix
    (m: the rest of its dimensions) at rank r: P (n x r) and Q (m x r), where (n + m) r is
    under half of n m (its min_compression_rate of 2)."""
    found = powersgd(cfg)
    if found is None:
        return 0
    grads = [p for p in parameters if p.requires_grad]
    errors = sum(p.numel() * p.element_size() for p in grads)
    factors = 0
    for p in grads:
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, found[0])
        if 2 * (n + m) * r < n * m:
            factors += (n + m) * r * p.element_size()
    return errors + 2 * min(errors, int(cfg.ddp.bucket_cap_mb * 2**20)) + factors


def workspace_bytes(cfg: TrainConfig, device: str, ddp: bool) -> int:
    """The cuBLAS workspaces a job on `device` keeps (`workspaces`; 0 on CPU); `ddp`: wrapped
    in DDP with a process group (PowerSGD runs only there)."""
    return workspaces(cfg, ddp) * cublas_workspace_size() if device == "cuda" else 0


def workspaces(cfg: TrainConfig, ddp: bool) -> int:
    """How many cuBLAS workspaces a CUDA job keeps: torch allocates one for each cuBLAS handle
    and stream that runs a matmul and keeps it (torch's CUDA notes, "cuBLAS workspaces"). A
    step runs its matmuls on two handles, the forward's thread's and that of autograd's
    backward thread for the device, on the current stream; PowerSGD's hook runs its own in
    future callbacks, each on the next of torch's pool streams, so it comes to hold one on
    each of them."""
    return 2 + (_POOL_STREAMS if ddp and powersgd(cfg) else 0)


def cublas_workspace_size() -> int:
    """One cuBLAS workspace on the current GPU: torch.backends.cuda.cublas_workspace_size()
    (torch >= 2.13), else as CUBLAS_WORKSPACE_CONFIG sets it (`:SIZE:COUNT` pairs, KiB),
    else torch's default: 32 MiB on compute capability 9.0 (Hopper, as cuBLAS recommends),
    else `:4096:2:16:8` (8 MiB + 128 KiB)."""
    query = getattr(torch.backends.cuda, "cublas_workspace_size", None)
    if query is not None:
        return int(query())
    configured = workspace_config(os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if configured is not None:
        return configured
    hopper = torch.cuda.get_device_capability() == (9, 0)
    return 32 * 2**20 if hopper else (4096 * 2 + 16 * 8) * 2**10


def workspace_config(text: str) -> int | None:
    """The bytes CUBLAS_WORKSPACE_CONFIG sets (`:4096:8`: 8 x 4096 KiB), None if it sets none."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", text)
    return sum(int(size) * int(count) for size, count in pairs) * 2**10 if pairs else None


def window_steps(cfg: TrainConfig, device: torch.device) -> int:
    """The steps the measured peak covers after the first (tracking/peak.py): 4 (a steady step
    repeats itself), and on CUDA with PowerSGD until it holds a workspace on every pool stream
    (`workspaces`): its callbacks take the next stream in turn, three a step, so each of them
    has run on all 32 within 32 steps of ddp.powersgd_start_iter."""
    found = powersgd(cfg) if device.type == "cuda" and cfg.ddp.wrapper == Wrapper.ddp else None
    return PeakMeter.STEPS if found is None else found[1] + _POOL_STREAMS + 1
