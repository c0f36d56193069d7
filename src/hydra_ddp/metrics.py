"""Measurements: process memory, evaluation with cross-rank reduction."""

from __future__ import annotations

import os
import resource
from contextlib import AbstractContextManager

import psutil
import torch
import torch.distributed as dist

from hydra_ddp.data import EvalData, Task
from hydra_ddp.dist import DistEnv
from hydra_ddp.models import loss_and_correct

_MB = 1024 * 1024


_process: psutil.Process | None = None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Current and peak resident memory of this process (and of its GPU, on CUDA), in MiB."""
    global _process
    if _process is None or _process.pid != os.getpid():  # one per process; a fork gets its own
        _process = psutil.Process()
    stats = {"rss_mb": _process.memory_info().rss / _MB,
             # ru_maxrss is in KiB on Linux.
             "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        stats["cuda_mem_mb"] = torch.cuda.memory_allocated(device) / _MB
        stats["cuda_peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / _MB
    return stats


def all_reduce_sum(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few numbers over all ranks (float64, so counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    if env.distributed:
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: EvalData, env: DistEnv, task: Task,
             autocast: AbstractContextManager) -> dict[str, float]:
    """Loss (and accuracy for classifiers) over a whole split, every row counted once.

    `model` must be the unwrapped module: a DDP forward may broadcast buffers, a collective
    that would hang when ranks hold different numbers of evaluation batches.
    """
    was_training = model.training
    model.eval()
    loss_sum = correct = count = 0.0
    for x, y in data:
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        with autocast:
            logits = model(x)
        loss, right = loss_and_correct(logits, y)
        n = y.numel()
        loss_sum += loss.item() * n
        correct += right.item()
        count += n
    model.train(was_training)
    loss_sum, correct, count = all_reduce_sum([loss_sum, correct, count], env)
    out = {"loss": loss_sum / max(count, 1), "count": count}
    if task == Task.classification:
        out["acc"] = correct / max(count, 1)
    return out
