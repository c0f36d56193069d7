"""Comparing what two runs left: checkpoints entry by entry, tensors and numbers exactly or
within a tolerance `tol` relative to one plus their magnitude."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A checkpoint's entries by path (`optimizer.state.0.exp_avg`, `rng[1].torch`)."""
    if isinstance(value, Mapping):
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(value)]
    else:
        return {prefix: value}
    return {key: v for name, item in items for key, v in flat(item, name).items()}


def differences(a: dict[str, Any], b: dict[str, Any], tol: float) -> list[str]:
    return [k for k in sorted(a.keys() | b.keys()) if not same(a.get(k), b.get(k), tol)]


def same(x: Any, y: Any, tol: float = 0.0) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if tol == 0 or not x.is_floating_point() or x.shape != y.shape:
            return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        return max_diff(x, y) <= tol * (1 + float(x.abs().max()))
    if isinstance(x, float) and isinstance(y, float):
        return close(x, y, tol)
    return type(x) is type(y) and x == y


def close(x: float, y: float, tol: float) -> bool:
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return abs(x - y) <= tol * (1 + abs(x))


def relative(got: torch.Tensor | None, ref: torch.Tensor) -> float:
    if got is None:
        return math.inf
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def max_diff(x: Any, y: Any) -> float:
    xs, ys = leaves(x), leaves(y)
    if [t.shape for t in xs] != [t.shape for t in ys]:
        return math.inf
    return max((float((p.double() - q.double()).abs().max()) for p, q in zip(xs, ys)
                if p.numel()), default=0.0)  # fmt: skip


def leaves(value: Any) -> list[torch.Tensor]:
    return [v for v in flat(value).values() if isinstance(v, torch.Tensor)]
