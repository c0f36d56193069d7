"""What the step optimises, for any batch: how a batch (a tuple `(inputs..., target)`, a dict, a
tensor, or a nesting of these) reaches the model, and how the loss sees the output; the rules,
from the user's side: docs/make_it_yours.md ("Any batch, any output, any loss").
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch

from hydra_ddp.errors import UserError, first_line

IGNORE_INDEX = -100  # targets with this value (padding) count in no loss or metric


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor moved to `device` (asynchronously from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:  # BatchEncoding and other dict-likes: keep their type where they allow it
            return moved if type(batch) is dict else type(batch)(moved)
        except Exception:
            return moved
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def rows(batch: Any) -> int:
    """The leading dimension of the batch's first tensor."""
    leaf = first_tensor(batch)
    if leaf is None or leaf.dim() == 0:
        raise UserError(
            f"a batch of type {type(batch).__name__} holds no tensor with a batch dimension: "
            "a batch is a tuple (inputs..., target), a dict of tensors, or a tensor"
        )
    return leaf.shape[0]


def first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for value in values:
            found = first_tensor(value)
            if found is not None:
                return found
    return None


def forward(model: Callable, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch[:-1]) if len(batch) > 1 else model(batch[0])
    return model(batch)


def target(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return batch.get("labels")
    if isinstance(batch, (list, tuple)) and len(batch) > 1:
        return batch[-1]
    return None


def weight(batch: Any) -> torch.Tensor | int:
    """How much a batch counts in a mean over a split: its targets (positions for text, without
    `IGNORE_INDEX` padding), else its rows."""
    y = target(batch)
    if isinstance(y, torch.Tensor) and y.dim() > 0:
        if not y.is_floating_point():
            return (y != IGNORE_INDEX).sum()
        return y.numel()
    return rows(batch)


class Caller:
    """Calls a loss or a metric method with what its parameters ask for: (output, target) by
    default, `batch=` and `model=` by name."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        # An nn.Module's __call__ takes *args: its forward says what it wants.
        try:
            signature = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
        except (TypeError, ValueError):
            signature = None
        names = [] if signature is None else list(signature.parameters.values())[1:]
        self.by_name = {p.name for p in names} & {"batch", "model"}
        positional = [
            p
            for p in names
            if p.name not in ("batch", "model")
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
            and (p.default is p.empty or p.kind == p.VAR_POSITIONAL)
        ]
        # A signature we cannot read (a builtin) gets the classic (output, target).
        self.wants_target = signature is None or bool(positional)

    def __call__(self, output: Any, batch: Any, model: Any = None) -> Any:
        args = (output, target(batch)) if self.wants_target else (output,)
        offered = {"batch": batch, "model": model}
        return self.fn(*args, **{name: offered[name] for name in self.by_name})


class BatchLoss:
    """The loss of one batch: `(output, batch, model) -> (loss, extras)`, extras being the other
    scalars of a dict-returning loss (detached)."""

    def __init__(self, loss_fn: Callable) -> None:
        self.loss_fn = loss_fn
        self.call = Caller(loss_fn)

    def __call__(
        self, output: Any, batch: Any, model: Any = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        try:
            value = self.call(output, batch, model)
        except (TypeError, AttributeError) as e:
            if not isinstance(output, (tuple, list)):
                raise
            # A model whose forward returns (logits, extra): the loss got the whole tuple.
            raise UserError(
                f"loss ({_name(self.loss_fn)}) cannot take the model's output, a "
                f"{type(output).__name__} of {len(output)} ({first_line(e, 120)}): it expects "
                "one tensor (logits or predictions) first; return only that from forward, or "
                "use a loss whose first parameter takes the tuple (`def loss(output, target)`)"
            ) from e
        if isinstance(value, Mapping):
            if "loss" not in value:
                raise UserError(
                    f"loss ({_name(self.loss_fn)}) returned a dict without a 'loss' entry "
                    f"(keys: {', '.join(map(str, value))}): return {{'loss': total, ...}}"
                )
            extras = {str(k): v.detach() for k, v in value.items() if k != "loss"}
            value = value["loss"]
        else:
            extras = {}
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise UserError(
                f"loss ({_name(self.loss_fn)}) returned {_describe(value)}, not a scalar "
                "tensor: return the mean loss (or a dict with it as 'loss')"
            )
        return value, extras


def _name(fn: Any) -> str:
    kind = fn if inspect.isfunction(fn) or inspect.isbuiltin(fn) else type(fn)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', kind)}"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
