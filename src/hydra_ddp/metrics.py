"""Evaluation metrics, evaluation over a split with cross-rank reduction, and memory stats.

A metric is a component (`metrics.<name>._target_`) with two methods: `sums(output, target)`
returns a 1-D tensor of sums over one batch (e.g. [correct, count]); `compute(totals)` turns
those sums, added over every batch of every rank, into the number reported as val/<name> and
test/<name>. Because only sums cross ranks, each metric is exact however the rows are split.
"""

from __future__ import annotations

import functools
import math
import os
import resource
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable, Mapping

import psutil
import torch

from hydra_ddp.dist import DistEnv, sum_by_name
from hydra_ddp.errors import UserError, first_line
from hydra_ddp.objective import IGNORE_INDEX, Caller, Objective, forward, to_device, weight

_MB = 1024 * 1024


class Metric:
    def sums(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """Sums over one batch (a 1-D tensor on the output's device). Name a parameter `batch`
        instead of the target to get the whole batch."""
        raise NotImplementedError

    def compute(self, totals: list[float]) -> float:
        raise NotImplementedError


def _count(target: torch.Tensor) -> torch.Tensor:
    """The number of targets as a float64 tensor on the target's device: stacked with sums that
    live there (a CPU tensor here is the "expected all tensors on the same device" crash)."""
    return torch.full((), target.numel(), dtype=torch.float64, device=target.device)


def _valid(target: torch.Tensor) -> torch.Tensor:
    """Positions that count: all but padding (IGNORE_INDEX, -100, as in Hugging Face labels)."""
    return target != IGNORE_INDEX


def logits_of(output: Any) -> torch.Tensor:
    """A model's logits: the output itself, or its `logits` (a dict's, or a Hugging Face output
    object's)."""
    if isinstance(output, Mapping):
        return output["logits"]
    return getattr(output, "logits", output)


def _nll_sum(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = logits_of(output)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        target.reshape(-1),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )


class Accuracy(Metric):
    """Share of positions whose argmax over the last axis is the target (padding excluded)."""

    def sums(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        valid = _valid(target)
        right = ((logits_of(output).argmax(-1) == target) & valid).sum()
        return torch.stack([right.double(), valid.sum().double()])

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1)


class Perplexity(Metric):
    """exp of the mean next-token negative log-likelihood (without label smoothing), over the
    positions that are not padding (IGNORE_INDEX)."""

    def sums(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return torch.stack([_nll_sum(output, target).double(), _valid(target).sum().double()])

    def compute(self, totals: list[float]) -> float:
        return math.exp(min(totals[0] / max(totals[1], 1), 700.0))


class BitsPerToken(Perplexity):
    """Mean negative log-likelihood in bits: bits per character on a character-level corpus."""

    def compute(self, totals: list[float]) -> float:
        return totals[0] / max(totals[1], 1) / math.log(2)


class MeanSquaredError(Metric):
    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        err = (output.double() - target.double().view_as(output)) ** 2
        return torch.stack([err.sum(), _count(target)])

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
                _count(y),
            ]
        )

    def compute(self, totals: list[float]) -> float:
        sse, total, squares, n = totals
        sst = squares - total * total / max(n, 1)
        return 1.0 - sse / sst if sst > 0 else float("nan")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data: Iterable,
    env: DistEnv,
    loss_fn: Callable,
    metrics: Mapping[str, Metric],
    autocast: AbstractContextManager,
    limit: int = 0,
) -> dict[str, float]:
    """The loss and every metric over a whole split, every row counted once across ranks
    (over the first `limit` batches of each rank only, when `limit` > 0). Collective.

    `model` must be the unwrapped module: a DDP forward may broadcast buffers, a collective
    that would hang when ranks hold different numbers of evaluation batches.
    """
    was_training = model.training
    model.eval()
    try:
        totals = score(model, data, env.device, loss_fn, metrics, autocast, limit)
    finally:
        model.train(was_training)
    # One copy to the host for the whole split.
    names = list(totals)
    flat = torch.cat([totals[n] for n in names]).cpu().tolist() if names else []
    local, at = {}, 0
    for name in names:
        size = totals[name].numel()
        local[name], at = flat[at : at + size], at + size
    # A rank may hold no rows of a split: summing by name needs no sizes agreed in advance.
    merged = sum_by_name(local, env)
    loss = merged.get("loss", [0.0, 0.0])
    out = {"loss": loss[0] / max(loss[1], 1)}
    for name, metric in metrics.items():
        out[name] = metric.compute(merged[name]) if name in merged else float("nan")
    return out


def score(
    model: torch.nn.Module,
    data: Iterable,
    device: torch.device,
    loss_fn: Callable,
    metrics: Mapping[str, Metric],
    autocast: AbstractContextManager,
    limit: int = 0,
) -> dict[str, torch.Tensor]:
    """This rank's sums over its batches of a split (`loss`: [loss x weight, weight], the weight
    being the batch's targets or rows, then each metric's `sums`), left on `device`: nothing is
    read back to the host here."""
    objective = loss_fn if isinstance(loss_fn, Objective) else Objective(loss_fn)
    callers = {name: Caller(m.sums) for name, m in metrics.items()}
    totals: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(data):
        if limit and i >= limit:
            break
        batch = to_device(batch, device)
        with autocast:
            output = forward(model, batch)
        parts = {"loss": functools.partial(_loss_sums, objective, output, batch, model)}
        parts.update({name: functools.partial(c, output, batch) for name, c in callers.items()})
        for name, sums in parts.items():
            s = _on_device(sums, name, metrics.get(name, objective.loss_fn), device)
            totals[name] = totals[name] + s if name in totals else s
    return totals


def _loss_sums(objective: Objective, output: Any, batch: Any, model: Any) -> torch.Tensor:
    # Weighted by targets per batch, so the mean is over positions (tokens) for text.
    loss, _ = objective(output, batch, model)
    w = weight(batch)
    w = w.double() if isinstance(w, torch.Tensor) else torch.full((), float(w), device=loss.device)
    return torch.stack([loss.double() * w, w.double()])


def _on_device(sums: Callable[[], torch.Tensor], name: str, owner: Any, device: torch.device):
    """Run one metric's (or the loss's) sums; a device mix-up becomes one line naming it."""
    key = "loss" if name == "loss" else f"metrics.{name}"
    what = f"{key} ({type(owner).__module__}.{type(owner).__qualname__})"
    try:
        s = sums()
    except RuntimeError as e:
        if "device" not in str(e):
            raise
        raise UserError(
            f"{what} mixes devices ({first_line(e)}): create its tensors on the output's device "
            "(torch.tensor(..., device=output.device) or output.new_tensor(...))"
        ) from e
    if s.device != device:
        raise UserError(
            f"{what} returned sums on {s.device}, but the model's output is on {device}: "
            "create them on the output's device (output.new_tensor(...))"
        )
    return s.reshape(-1).double()


_process: psutil.Process | None = None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Current and peak resident memory of this process (and of its GPU, on CUDA, where the
    peak is since the previous call), in MiB."""
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
        # Per interval: the next call reports the peak since this one.
        torch.cuda.reset_peak_memory_stats(device)
    return stats
