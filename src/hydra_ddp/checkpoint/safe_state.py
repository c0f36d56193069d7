"""What a checkpoint may hold: the types `torch.load(weights_only=True)` reads back.

Resume and evaluation read checkpoints with weights_only=True, which refuses any object whose
class it does not know (it would have to import and call code). So the state is made plain
before it is written: numpy scalars become Python numbers, numpy arrays tensors (lists for
arrays of strings or objects), and tuple/dict/list subclasses (a namedtuple, a defaultdict),
frozensets and paths their plain counterparts. Anything else (a user's class, an Enum, a
datetime) is refused at save, in one line naming where it is, rather than found at resume
when the run can no longer be continued. Containers in which nothing changes are kept as
they are (a model's state_dict keeps its `_metadata`).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np
import torch

from hydra_ddp.errors import UserError

# Held as they are: weights_only reads these (builtins by pickle opcode, the rest allowlisted).
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_ATOMS = (torch.Tensor, torch.dtype, torch.device, torch.Size)
_DICTS = (dict, collections.OrderedDict, collections.Counter)
# A structure nested deeper than this is taken for a cycle.
_MAX_DEPTH = 200


class Unloadable(Exception):
    """A value weights_only would refuse: `where` is its key path, `kind` its type's name."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(f"{where}: {kind}")
        self.where, self.kind = where, kind


def loadable(value: Any, where: str = "") -> Any:
    """`value` with everything made a type weights_only reads; raises Unloadable (naming the
    key path from `where` on) for a value that has none."""
    return _plain(value, where, 0)


def checked(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's members made loadable; a member that cannot be is one UserError naming
    it (for a callback: `callbacks.<name>` and the key in its state_dict)."""
    out: dict[str, Any] = {}
    for member, value in state.items():
        # The callbacks' states, by callback name: each is named on its own.
        parts = value.items() if member == "callbacks" else [(None, value)]
        made = {}
        for name, part in parts:
            try:
                made[name] = loadable(part)
            except Unloadable as e:
                owner = f"callbacks.{name}" if name is not None else f"the checkpoint's {member}"
                raise UserError(
                    f"{owner}: state_dict(){e.where} holds a {e.kind}, which "
                    "torch.load(weights_only=True) cannot read back, so no resume could load "
                    "this checkpoint: return tensors, numbers, strings, lists, tuples or dicts "
                    "from state_dict() (numpy values are converted)"
                ) from None
        out[member] = made if member == "callbacks" else made[None]
    return out


def _plain(value: Any, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise Unloadable(where, f"structure nested over {_MAX_DEPTH} deep (a cycle?)")
    if type(value) in _ATOMS or isinstance(value, _TORCH_ATOMS):
        return value
    if isinstance(value, np.generic):  # np.float64, np.int64, np.bool_, np.str_
        return _plain(value.item(), where, depth + 1)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biufc":
            return torch.from_numpy(np.array(value, copy=True, order="C"))
        return _plain(value.tolist(), where, depth + 1)
    if isinstance(value, (bool, int, float, complex, str, bytes)):  # an IntEnum, a str subclass
        return _base(value)(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        items = [
            (_plain(k, f"{where}[{k!r}]", depth + 1), _plain(v, f"{where}[{k!r}]", depth + 1))
            for k, v in value.items()
        ]
        if type(value) in _DICTS and all(
            a is k and b is v for (a, b), (k, v) in zip(items, value.items())
        ):
            return value
        return dict(items)
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = list(value)
        items = [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(seq)]
        # A namedtuple becomes a tuple, a frozenset a set (weights_only reads neither).
        plain_type = list if isinstance(value, list) else tuple if isinstance(value, tuple) else set
        if type(value) is plain_type and all(a is b for a, b in zip(items, seq)):
            return value
        return plain_type(items)
    kind = type(value)
    raise Unloadable(where, f"{kind.__module__}.{kind.__qualname__}")


def _base(value: Any) -> type:
    return next(t for t in (bool, int, float, complex, str, bytes) if isinstance(value, t))


def to_cpu(obj: Any) -> Any:
    """`obj` with its tensors on the CPU: a CUDA tensor pickled by rank 1 would be unpickled
    onto rank 1's GPU by rank 0's process."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
