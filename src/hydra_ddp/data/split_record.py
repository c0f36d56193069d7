"""Which rows are training rows: what a checkpoint records of the split, and what a resume that
changes it (`data.split_seed`, `data.val_fraction`, ...) says.

A source's `origin(split)` gives the split's rows as half-open ranges of the original data set
(characters for text). The checkpoint records a fingerprint of the training rows, the held-out
rows (compressed ranges) and the settings that cut them (`split_settings`); a resume whose
training rows differ warns with how many of the checkpoint's val/test rows are training rows
now, and how many of its training rows are held out now. A source without `origin` is not
checked.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import zlib
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MAX_RANGES = 1_000_000  # held-out ranges kept for the counts (16 bytes each before compression)


def ranges_of(rows: np.ndarray) -> np.ndarray:
    """Sorted distinct row numbers as half-open ranges, an (n, 2) int64 array."""
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    if not len(rows):
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts, stops = rows[np.r_[0, breaks]], rows[np.r_[breaks - 1, len(rows) - 1]] + 1
    return np.stack([starts, stops], axis=1)


def _merged(ranges: list[tuple[int, int]]) -> np.ndarray:
    """Half-open ranges as sorted, disjoint, merged ranges (an (n, 2) int64 array)."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def overlap(a: np.ndarray, b: np.ndarray) -> int:
    """Rows in both sets of disjoint ranges: |a| + |b| - |a or b|."""
    return _size(a) + _size(b) - _size(_merged([*a, *b]))


def _size(ranges: np.ndarray) -> int:
    return int((ranges[:, 1] - ranges[:, 0]).sum())


def _encode(ranges: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(ranges.astype("<i8").tobytes())).decode("ascii")


def _decode(text: str) -> np.ndarray:
    raw = zlib.decompress(base64.b64decode(text))
    return np.frombuffer(raw, dtype="<i8").reshape(-1, 2)


def recorded_split(source: Any) -> dict[str, Any] | None:
    """What a checkpoint records of `source`'s split (None: the source does not say)."""
    origin = getattr(source, "origin", None)
    if not callable(origin):
        return None
    parts = {s: origin(s) for s in ("train", "val", "test")}
    if any(p is None for p in parts.values()):
        return None
    train = _merged(parts["train"])
    held = _merged([*parts["val"], *parts["test"]])
    return {
        "settings": dict(getattr(source, "split_settings", None) or {}),
        "unit": str(getattr(source, "origin_unit", "rows")),
        "train": hashlib.sha256(train.astype("<i8").tobytes()).hexdigest()[:32],
        "train_size": _size(train),
        "held_out": _encode(held) if len(held) <= MAX_RANGES else None,
        "_train_ranges": train,  # this job's, for the counts; not saved (see saved_form)
    }


def saved_form(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    """The record as a checkpoint holds it (plain values only)."""
    return None if rec is None else {k: v for k, v in rec.items() if not k.startswith("_")}


def say_changed(path: Any, saved: dict[str, Any] | None, here: dict[str, Any] | None) -> None:
    """One warning when this job's training rows are not the checkpoint's; nothing when they
    are, or when either side does not record them."""
    if not isinstance(saved, dict) or here is None or saved.get("train") == here["train"]:
        return
    old, new = saved.get("settings") or {}, here["settings"]
    was = ", ".join(
        f"data.{k}={old.get(k)} then, {new.get(k)} now"
        for k in sorted({*old, *new})
        if old.get(k) != new.get(k)
    )
    unit = here["unit"]
    head = (
        f"{path or 'the checkpoint'} was trained on another split of "
        f"the data than this job's ({was or 'the data set changed'}; "
        f"{saved.get('train_size')} training {unit} then, {here['train_size']} now)"
    )
    if saved.get("held_out") is None or here["held_out"] is None:
        log.warning(
            "%s: some of its val/test %s may be training %s now; resume with the checkpoint's "
            "data settings to keep them apart",
            head, unit, unit,
        )  # fmt: skip
        return
    held_then, held_now = _decode(saved["held_out"]), _decode(here["held_out"])
    now_trained = overlap(held_then, here["_train_ranges"])
    now_held = _size(held_now) - overlap(held_now, held_then)
    log.warning(
        "%s: %d of its val/test %s are training %s now and %d of its training %s are "
        "val/test %s now (val/test metrics no longer held out); resume with the checkpoint's "
        "data settings to keep them apart, or start a new run",
        head, now_trained, unit, unit, now_held, unit, unit,
    )  # fmt: skip
