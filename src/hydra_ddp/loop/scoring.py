"""A split through the model: the loss and every metric over all of its rows, exact across
ranks (`evaluate`), or one prediction per row, gathered on rank 0 (`predict`, behind
`python -m hydra_ddp.eval run=<dir> predict=true`; what it keeps: docs/make_it_yours.md).

Each rank adds up its batches' sums (`Metric.sums`, the loss weighted by its targets) on its
device, and only those sums cross ranks, so the result does not depend on how the rows were
split. Every rank walks through as many batches (data/view.py), so a metric that
gathers pairs its collectives; a padded batch runs but is not counted, and the sums of a metric
with `gathers = True` (the whole global batch's, on every rank) are counted on rank 0 only.
"""

from __future__ import annotations

import functools
import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from hydra_ddp.batches import BatchLoss, Caller, forward, to_device, weight
from hydra_ddp.data import EvalData
from hydra_ddp.distributed import DistEnv, all_gather_objects, evaluation_batch, sum_by_name
from hydra_ddp.errors import UserError, first_line
from hydra_ddp.rundir import jsonfile

if TYPE_CHECKING:
    from hydra_ddp.metrics import Metric

log = logging.getLogger(__name__)


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
    # A rank may hold no rows of a split: summing by name needs no sizes agreed in advance.
    merged = sum_by_name({name: t.tolist() for name, t in totals.items()}, env)
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


def prediction_entries(
    output: Any, rows: int, key: str | None
) -> tuple[str, dict[str, torch.Tensor], list]:
    """The kind of `output` (tensor, tuple, dict), its entries kept for prediction, by name
    ("" for a tensor, "0", "1", ... for a tuple's), and the names of those left out: a tensor
    or the logits (of a Hugging Face output, or a dict) whole, else each tensor entry with one
    row per batch row, or `key`'s alone."""
    if key is not None:
        if isinstance(output, Mapping):
            value = output.get(key)
            names = ", ".join(map(str, output))
        else:
            value, names = getattr(output, key, None), f"a {type(output).__name__}"
        if not isinstance(value, torch.Tensor):
            raise UserError(f"predict_key={key} is no tensor of the model's output ({names})")
        return "tensor", {"": _per_row(value, rows, f"output[{key!r}]")}, []
    logits = output.get("logits") if isinstance(output, Mapping) else None
    logits = getattr(output, "logits", None) if logits is None else logits
    if isinstance(logits, torch.Tensor):  # a Hugging Face output, or a dict with logits
        return "tensor", {"": _per_row(logits, rows, "the output's logits")}, []
    if isinstance(output, torch.Tensor):
        return "tensor", {"": _per_row(output, rows, "the output")}, []
    if isinstance(output, (tuple, list)):
        items = {str(i): v for i, v in enumerate(output)}
        kind = "tuple"
    elif isinstance(output, Mapping):
        items, kind = {str(k): v for k, v in output.items()}, "dict"
    else:
        raise UserError(
            f"predict: the model's output is a {type(output).__name__}; predictions are made "
            "of a tensor, a tuple or a dict of tensors (predict_key=<name> picks one)"
        )
    out = {n: v for n, v in items.items() if isinstance(v, torch.Tensor) and _rows(v) == rows}
    if not out:
        raise UserError(
            f"predict: no entry of the model's {kind} output has one row per batch row ({rows}); "
            f"its entries: {', '.join(items)}"
        )
    return kind, out, [n for n in items if n not in out]


def _rows(t: torch.Tensor) -> int | None:
    return t.shape[0] if t.dim() else None


def _per_row(value: Any, rows: int, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or _rows(value) != rows:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserError(
            f"predict: {what} ({shape}) has no row per batch row ({rows}): predictions need "
            "outputs whose first dimension is the batch; pick another entry with predict_key"
        )
    return value


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    split: Any,
    env: DistEnv,
    autocast: Any,
    out: Path,
    key: str | None = None,
    pad: float | None = None,
) -> None:
    """Collective: every row's output, gathered on rank 0 in the split's row order, saved to
    `out` (and its description next to it, `.json`)."""
    row_ids: list[torch.Tensor] = []
    parts: dict[str, list[torch.Tensor]] = {}
    kind, size = None, 0
    row_batches = list(split.rows())  # first: the sampler is iterated once at a time
    for ids, batch in zip(row_batches, split):
        with autocast:
            output = forward(model, to_device(batch, env.device))
        if not len(ids):  # a padded batch (data/view.py): run, but not kept
            continue
        kind, entries, dropped = prediction_entries(output, len(ids), key)
        size = len(entries) + len(dropped)
        if dropped and not parts and env.is_main:
            log.info("predict: left out of the %s output (no row per batch row): %s", kind,
                     ", ".join(dropped))  # fmt: skip
        if parts and set(entries) != set(parts):
            raise UserError(
                f"predict: the model's output holds {sorted(entries)} in one batch and "
                f"{sorted(parts)} in another: give predict_key=<name>"
            )
        for name, value in entries.items():
            value = value.detach()
            parts.setdefault(name, []).append(value.float().cpu() if value.is_floating_point()
                                              else value.cpu())  # fmt: skip
        row_ids.append(torch.as_tensor(ids))
    mine = (kind, size, torch.cat(row_ids), parts) if row_ids else None
    gathered = [p for p in all_gather_objects(mine, env) if p is not None]  # collective
    if not env.is_main:
        return
    if not gathered:
        raise UserError(f"predict: the split is empty: nothing to write to {out}")
    kind, size = gathered[0][:2]
    order = torch.cat([ids for _, _, ids, _ in gathered]).argsort()
    described: dict[str, Any] = {}
    entries: dict[str, Any] = {}
    for name in gathered[0][3]:
        batches = [b for *_, p in gathered for b in p[name]]
        entries[name], described[name or "output"] = _assemble(batches, order, pad)
    if kind == "tuple":  # None: an entry not per row
        torch.save(tuple(entries.get(str(i)) for i in range(size)), out)
    else:
        torch.save(entries[""] if kind == "tensor" else entries, out)
    jsonfile.write(
        out.with_suffix(".json"),
        {"rows": len(order), "kind": kind, "key": key, "pad_value": pad, "entries": described},
    )
    log.info("predictions: %s (%d rows, %s: %s)", out, len(order), kind, _fmt(described))


def _assemble(
    batches: list[torch.Tensor], order: torch.Tensor, pad: float | None
) -> tuple[Any, dict]:
    """One entry over the split in row order: one tensor when every batch has the same shape
    past the rows, else a list of rows (or, with `pad`, one tensor padded to the longest)."""
    dtype = str(batches[0].dtype).replace("torch.", "")
    if len({b.shape[1:] for b in batches}) == 1:
        whole = torch.cat(batches)[order]
        return whole, {"shape": list(whole.shape), "dtype": dtype, "padded": False}
    rows = [r for b in batches for r in b.unbind(0)]
    rows = [rows[i] for i in order.tolist()]
    if pad is None:
        return rows, {"shape": "one tensor per row", "dtype": dtype, "padded": False}
    longest = [max(r.shape[d] for r in rows) for d in range(rows[0].dim())]
    whole = torch.full((len(rows), *longest), pad, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        whole[(i, *(slice(0, n) for n in r.shape))] = r
    return whole, {"shape": list(whole.shape), "dtype": dtype, "padded": True}


def _fmt(described: dict[str, Any]) -> str:
    return ", ".join(
        f"{name} {tuple(d['shape']) if isinstance(d['shape'], list) else d['shape']}"
        for name, d in described.items()
    )
