"""Predictions of a whole split, one per row in the split's order, gathered on rank 0
(`python -m hydra_ddp.eval run=<dir> predict=true`; what is kept of an output, and the files
written: docs/make_it_yours.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from hydra_ddp.batches import forward, to_device
from hydra_ddp.distributed import DistEnv, all_gather_objects
from hydra_ddp.errors import UserError
from hydra_ddp.rundir import jsonfile

log = logging.getLogger(__name__)


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
        if not len(ids):  # a padded batch (data/eval_batches.py): run, but not kept
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
    saved = _structure(kind, entries, size)
    torch.save(saved, out)
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


def _structure(kind: str, entries: dict[str, Any], size: int) -> Any:
    if kind == "tensor":
        return entries[""]
    if kind == "tuple":
        return tuple(entries.get(str(i)) for i in range(size))  # None: an entry not per row
    return entries


def _fmt(described: dict[str, Any]) -> str:
    return ", ".join(
        f"{name} {tuple(d['shape']) if isinstance(d['shape'], list) else d['shape']}"
        for name, d in described.items()
    )
