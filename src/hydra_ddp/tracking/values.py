"""What `ctx.log` accepts, the same rule for every sink (README, "Callbacks"):

* a number (int, float, bool, a numpy scalar) or a one-element tensor is a scalar: it goes to
  this rank's stats file, W&B and TensorBoard;
* a string is text: the stats file, W&B (as preformatted HTML) and TensorBoard (as text);
* a W&B media object (wandb.Image, wandb.Histogram, ...) goes to W&B only; the stats file
  records a placeholder (``"<wandb.Image>"``) at its step, TensorBoard leaves it out;
* a DTensor (ddp=fsdp2) must be whole by then: callbacks.Context.log makes it so (its
  `.item()` would read this rank's part only); one that reaches here is refused;
* anything else (a list, a dict, a tensor of several elements, None) is refused in one line;
* so is a key that the row or the template's own stats use (step, rank, loss, lr, ...: see
  names.is_reserved), which would otherwise overwrite the row or join the training series.

The errors are ValueErrors: callbacks.Callbacks turns them into one line naming the callback.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Iterable, Mapping

import torch
from torch.distributed.tensor import DTensor

from hydra_ddp.tracking import names


def is_media(value: Any) -> bool:
    """A W&B object (wandb.Image, ...), recognised without importing W&B."""
    return type(value).__module__.split(".")[0] == "wandb"


def loggable_values(values: Mapping[str, Any], logged: Iterable[str]) -> Dict[str, Any]:
    """`values` as the sinks take them: scalars as float or int, text, W&B media; raises a
    one-line ValueError for a reserved key or a value of no sink's type."""
    seen = set(logged)
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"ctx.log keys are non-empty strings, not {key!r}")
        if names.is_reserved(key, seen):
            raise ValueError(
                f"ctx.log key {key!r} is a field or stat the template logs itself (step, "
                "rank, loss, lr, step_time, ...): give your value another name"
            )
        out[key] = _scalar_or_text(key, value)
    return out


def _scalar_or_text(key: str, value: Any) -> Any:
    if isinstance(value, (str, bool, int)) or is_media(value):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, DTensor):
        raise ValueError(
            f"ctx.log value {key!r} is a DTensor, of which this rank holds a part: call "
            ".full_tensor() on it on every rank and log that"
        )
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    size = getattr(value, "size", None)
    if type(value).__module__ == "numpy" and size == 1:
        return value.item()
    what = (
        f"a tensor of {value.numel()} elements" if torch.is_tensor(value) else type(value).__name__
    )
    raise ValueError(
        f"ctx.log value {key!r} is {what}: log a number, a one-element tensor, a string or a "
        "W&B media object (wandb.Image, wandb.Histogram, ...)"
    )


def plain(value: Any) -> Any:
    """The value as the stats file records it: W&B media as a placeholder."""
    return (
        f"<{type(value).__module__.split('.')[0]}.{type(value).__name__}>"
        if is_media(value)
        else value
    )
