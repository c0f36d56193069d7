"""Reader for the ``.wandb`` transaction log that W&B writes for offline runs.

wandb 0.31 ships no public reader (the writer lives in the Go ``wandb-core``
binary), so the tests decode the file themselves. The format, verified against
files written by wandb 0.31.0, is a LevelDB-style log:

* a 7-byte file header: ``b":W&B"``, a little-endian uint16 magic (0xBEE1) and
  a version byte (0);
* then 32 KiB blocks (the file header counts towards the first block); each
  record is split into chunks with a 7-byte header: CRC32 (IEEE, i.e.
  ``zlib.crc32``, *not* LevelDB's masked CRC32C) over the type byte followed
  by the payload, a little-endian uint16 payload length, and a type byte
  (1 full, 2 first, 3 middle, 4 last);
* a chunk never straddles a block boundary: a block tail shorter than a chunk
  header is zero padding.

Each reassembled record is a serialized ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

__all__ = [
    "WandbLogError",
    "read_records",
    "history_rows",
    "run_info",
    "exit_code",
    "metric_definitions",
]

FILE_IDENT = b":W&B"
FILE_MAGIC = 0xBEE1
FILE_VERSION = 0
HEADER_LEN = 7
BLOCK_LEN = 32 * 1024

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbLogError(ValueError):
    """The file is not a well-formed W&B transaction log."""


def _payloads(data: bytes, path: Path) -> list[bytes]:
    """Split the raw file into reassembled record payloads."""
    if len(data) < HEADER_LEN:
        raise WandbLogError(f"{path}: too short for a W&B log header")
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER_LEN])
    if ident != FILE_IDENT or magic != FILE_MAGIC or version != FILE_VERSION:
        raise WandbLogError(
            f"{path}: bad header {data[:HEADER_LEN]!r} "
            f"(want {FILE_IDENT!r}, magic {FILE_MAGIC:#x}, version {FILE_VERSION})"
        )

    payloads: list[bytes] = []
    pending: list[bytes] | None = None
    pos = HEADER_LEN
    while pos < len(data):
        block_left = BLOCK_LEN - pos % BLOCK_LEN
        if block_left < HEADER_LEN:
            # Trailer too small for a chunk header: the writer zero-pads it.
            pos += block_left
            continue
        if pos + HEADER_LEN > len(data):
            break  # a run still being written can end mid-header
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER_LEN])
        if kind == 0 and length == 0 and crc == 0:
            # Zeroed space (preallocation or padding): nothing more in this block.
            pos += block_left
            continue
        end = pos + HEADER_LEN + length
        if length > block_left - HEADER_LEN:
            raise WandbLogError(f"{path}: chunk at {pos} crosses a block boundary")
        if end > len(data):
            break  # truncated tail of a live run
        chunk = data[pos + HEADER_LEN : end]
        if zlib.crc32(bytes([kind]) + chunk) != crc:
            raise WandbLogError(f"{path}: CRC mismatch in chunk at offset {pos}")
        pos = end

        if kind == FULL:
            if pending is not None:
                raise WandbLogError(f"{path}: FULL chunk inside a fragmented record")
            payloads.append(chunk)
        elif kind == FIRST:
            if pending is not None:
                raise WandbLogError(f"{path}: FIRST chunk inside a fragmented record")
            pending = [chunk]
        elif kind == MIDDLE:
            if pending is None:
                raise WandbLogError(f"{path}: MIDDLE chunk without FIRST at {pos}")
            pending.append(chunk)
        elif kind == LAST:
            if pending is None:
                raise WandbLogError(f"{path}: LAST chunk without FIRST at {pos}")
            pending.append(chunk)
            payloads.append(b"".join(pending))
            pending = None
        else:
            raise WandbLogError(f"{path}: unknown chunk type {kind} at {pos}")
    return payloads


def read_records(path: str | Path) -> list[pb.Record]:
    """Return every record in a ``.wandb`` file, in write order."""
    p = Path(path)
    records: list[pb.Record] = []
    for payload in _payloads(p.read_bytes(), p):
        rec = pb.Record()
        rec.ParseFromString(payload)
        records.append(rec)
    return records


def _item_key(item: Any) -> str:
    """History/config/summary items carry either ``key`` or ``nested_key``."""
    return item.key if item.key else "/".join(item.nested_key)


def _history_value(item: pb.HistoryItem) -> object:
    """Decode a history item: wandb 0.31 may use a typed oneof or value_json."""
    which = item.WhichOneof("value")
    if which == "none":
        return None
    if which in ("boolean", "integer", "number", "text"):
        return getattr(item, which)
    if which == "json":
        return json.loads(item.json)
    return json.loads(item.value_json) if item.value_json else None


def history_rows(path: str | Path) -> list[dict[str, object]]:
    """Return each logged history row as a flat ``{key: value}`` dict."""
    rows: list[dict[str, object]] = []
    for rec in read_records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        rows.append({_item_key(it): _history_value(it) for it in rec.history.item})
    return rows


def _apply_config(config: dict[str, Any], record: pb.ConfigRecord) -> None:
    for item in record.update:
        config[_item_key(item)] = json.loads(item.value_json)
    for item in record.remove:
        config.pop(_item_key(item), None)


def run_info(path: str | Path) -> dict[str, Any]:
    """Summarise the run: id, group, job_type, name, project, tags and config.

    The config is the run record's initial config with later config records
    applied, minus W&B's internal ``_wandb`` entry.
    """
    info: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for rec in read_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
            info.update(
                id=run.run_id,
                group=run.run_group,
                job_type=run.job_type,
                name=run.display_name,
                project=run.project,
                entity=run.entity,
                tags=list(run.tags),
            )
            _apply_config(raw, run.config)
        elif kind == "config":
            _apply_config(raw, rec.config)
    raw.pop("_wandb", None)
    info["config"] = raw
    return info


def exit_code(path: str | Path) -> int | None:
    """Return the exit code of the run's exit record, or None if it never finished."""
    code: int | None = None
    for rec in read_records(path):
        if rec.WhichOneof("record_type") == "exit":
            code = rec.exit.exit_code
    return code


def metric_definitions(path: str | Path) -> dict[str, str]:
    """Map each ``define_metric`` name or glob to its step metric ('' if none)."""
    defs: dict[str, str] = {}
    for rec in read_records(path):
        if rec.WhichOneof("record_type") == "metric":
            m = rec.metric
            defs[m.glob_name or m.name] = m.step_metric
    return defs
