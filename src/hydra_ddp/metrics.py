"""Evaluation metrics, evaluation over a split with cross-rank reduction, and memory stats.

A metric is a component (`metrics.<name>._target_`) with two methods: `sums(output, target)`
returns a 1-D tensor of sums over one batch (e.g. [correct, count]); `compute(totals)` turns
those sums, added over every batch of every rank, into the number reported as val/<name> and
test/<name>. Because only sums cross ranks, each metric is exact however the rows are split.
"""

from __future__ import annotations

import math
import os
import resource
from contextlib import AbstractContextManager
from typing import Callable, Mapping

import psutil
import torch

from hydra_ddp.dist import DistEnv, sum_by_name

_MB = 1024 * 1024


class Metric:
    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute(self, totals: list[float]) -> float:
        raise NotImplementedError


def _nll_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="sum"
    )


class Accuracy(Metric):
    """Share of positions whose argmax over the last axis is the target."""

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        right = (output.argmax(-1) == target).sum()
        return torch.stack([right.double(), torch.tensor(target.numel(), dtype=torch.float64)])

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1)


class Perplexity(Metric):
    """exp of the mean next-token negative log-likelihood (without label smoothing)."""

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [_nll_sum(output, target).double(), torch.tensor(target.numel(), dtype=torch.float64)]
        )

    def compute(self, totals: list[float]) -> float:
        return math.exp(min(totals[0] / max(totals[1], 1), 700.0))


class BitsPerToken(Perplexity):
    """Mean negative log-likelihood in bits: bits per character on a character-level corpus."""

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1) / math.log(2)


class MeanSquaredError(Metric):
    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        err = (output.double() - target.double().view_as(output)) ** 2
        return torch.stack([err.sum(), torch.tensor(target.numel(), dtype=torch.float64)])

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1)


class R2Score(Metric):
    """Coefficient of determination, 1 - SSE / SST, over all targets of the split."""

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = target.double().view_as(output)
        return torch.stack(
            [
                ((output.double() - y) ** 2).sum(),
                y.sum(),
                (y**2).sum(),
                torch.tensor(y.numel(), dtype=torch.float64),
            ]
        )

    def compute(self, totals: list[float]) -> float:
        sse, total, squares, n = totals
        sst = squares - total * total / max(n, 1)
        return 1.0 - sse / sst if sst > 0 else float("nan")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data,
    env: DistEnv,
    loss_fn: Callable,
    metrics: Mapping[str, Metric],
    autocast: AbstractContextManager,
    limit: int = 0,
) -> dict[str, float]:
    """The loss and every metric over a whole split, every row counted once across ranks
    (over the first `limit` batches of each rank only, when `limit` > 0).

    `model` must be the unwrapped module: a DDP forward may broadcast buffers, a collective
    that would hang when ranks hold different numbers of evaluation batches.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    count = 0
    totals: dict[str, torch.Tensor] = {}
    for i, (x, y) in enumerate(data):
        if limit and i >= limit:
            break
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        with autocast:
            output = model(x)
        # Weighted by targets per batch, so the mean is over positions (tokens) for text.
        loss_sum += loss_fn(output, y).double() * y.numel()
        count += y.numel()
        for name, metric in metrics.items():
            s = metric.sums(output, y).to(loss_sum.device)
            totals[name] = totals[name] + s if name in totals else s
    model.train(was_training)
    local = {name: t.tolist() for name, t in totals.items()}
    local["loss"] = [float(loss_sum), float(count)]
    # A rank may hold no rows of a split: summing by name needs no sizes agreed in advance.
    merged = sum_by_name(local, env)
    out = {"loss": merged["loss"][0] / max(merged["loss"][1], 1)}
    for name, metric in metrics.items():
        out[name] = metric.compute(merged[name]) if name in merged else float("nan")
    return out


_process: psutil.Process | None = None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Current and peak resident memory of this process (and of its GPU, on CUDA), in MiB."""
    global _process
    if _process is None or _process.pid != os.getpid():  # one per process; a fork gets its own
        _process = psutil.Process()
    stats = {
        "rss_mb": _process.memory_info().rss / _MB,
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if device.type == "cuda":
        stats["cuda_mem_mb"] = torch.cuda.memory_allocated(device) / _MB
        stats["cuda_peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / _MB
    return stats
