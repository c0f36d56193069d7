"""Scoring a split: the loss and every metric over all of its rows, exact across ranks.

Each rank adds up its batches' sums (`Metric.sums`, the loss weighted by its targets) on its
device, and only those sums cross ranks, so the result does not depend on how the rows were
split. Every rank walks through as many batches (data/eval_batches.py), so a metric that
gathers pairs its collectives; a padded batch runs but is not counted, and the sums of a metric
with `gathers = True` (the whole global batch's, on every rank) are counted on rank 0 only.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from hydra_ddp.batches import BatchLoss, Caller, forward, to_device, weight
from hydra_ddp.data import EvalData
from hydra_ddp.distributed import DistEnv, evaluation_batch, sum_by_name
from hydra_ddp.errors import UserError, first_line

if TYPE_CHECKING:
    from hydra_ddp.metrics import Metric


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
    """Collective: the loss and every metric over a whole split (the first `limit` batches of
    each rank, when > 0). `model` must be the unwrapped module: a DDP forward may broadcast
    buffers, a collective that would hang when ranks hold different numbers of batches."""
    was_training = model.training
    model.eval()
    try:
        totals = score(model, data, env.device, loss_fn, metrics, autocast, limit, env.rank)
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
    rank: int = 0,
) -> dict[str, torch.Tensor]:
    """This rank's sums over its batches of a split (`loss`: [loss x weight, weight], the weight
    being the batch's targets or rows; each metric's `sums`), left on `device`."""
    objective = loss_fn if isinstance(loss_fn, BatchLoss) else BatchLoss(loss_fn)
    callers = {name: Caller(m.sums) for name, m in metrics.items()}
    # A metric that gathers has the global batch's sums on every rank: rank 0's count.
    once = {name for name, m in metrics.items() if getattr(m, "gathers", False)}
    totals: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(data):
        if limit and i >= limit:
            break
        padded = data.padded_ranks(i) if isinstance(data, EvalData) else None
        batch = to_device(batch, device)
        with autocast:
            output = forward(model, batch)
        parts = {"loss": functools.partial(_loss_sums, objective, output, batch, model)}
        parts.update({name: functools.partial(c, output, batch) for name, c in callers.items()})
        with evaluation_batch(padded):
            for name, sums in parts.items():
                # Run on a padded batch too (a loss or metric may gather), but not counted.
                s = _on_device(sums, name, metrics.get(name, objective.loss_fn), device)
                counted = rank == 0 if name in once else not (padded and padded[rank])
                s = s if counted else torch.zeros_like(s)
                totals[name] = totals[name] + s if name in totals else s
    return totals


def _loss_sums(objective: BatchLoss, output: Any, batch: Any, model: Any) -> torch.Tensor:
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
