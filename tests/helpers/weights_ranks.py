"""trainer.init_from's loading on real gloo ranks (helpers/ranks.py), each format into a whole
model (what a DDP rank loads before the wrap), into ddp=fsdp2's shards after the wrap, and
into the shards of a model built on the meta device (ddp.meta_init)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hydra_ddp.checkpoint.init_from import apply, open_weights, plan
from hydra_ddp.checkpoint.reader import MANIFEST, crc32
from hydra_ddp.config import DDPConfig, Wrapper
from hydra_ddp.distributed.fsdp import full, wrap
from hydra_ddp.models import GPT

# ddp.meta_init loads the same way as fsdp2 after its wrap: a few sources show it.
META = ("dcp", "safetensors", "partial")


def write_sharded(env: Any, args: dict, reference: str, folder: str) -> None:
    """Collective: the GPT of `args` with the `reference` weights, sharded by fully_shard and
    saved as a checkpoint folder of this template (DCP's files, and the manifest that says it
    is whole)."""
    model = GPT(**args)
    model.load_state_dict(torch.load(reference, weights_only=True))
    wrap(model, env, DDPConfig(wrapper=Wrapper.fsdp2))
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder)
    torch.distributed.barrier()
    if env.is_main:
        files = {p.name: [p.stat().st_size, crc32(p)] for p in Path(folder).iterdir()}
        (Path(folder) / MANIFEST).write_text(json.dumps({"files": files}))
    torch.distributed.barrier()


def load_each(
    env: Any, sources: dict[str, tuple[str, dict, bool]], args: dict, reference: str, tmp: str
) -> dict[str, tuple[str, float]]:
    """Each source (path, init_map, strict) loaded into a whole model, into fully_shard's
    shards, and (ddp.meta_init) into shards of a model built on the meta device: its load line
    and the largest difference of a loaded tensor from `reference` (the state dict the sources
    were all made from)."""
    expected = torch.load(reference, weights_only=True)
    folder = str(Path(tmp) / "from_fsdp2.dcp")  # written by these ranks from the reference
    write_sharded(env, args, reference, folder)
    sources = {**sources, "dcp": (folder, {}, True)}
    results = {}
    for mode in ("whole", "fsdp2", "meta"):
        for name, (path, init_map, strict) in sources.items():
            if mode == "meta" and name not in META:
                continue
            torch.manual_seed(env.rank)  # what a rank starts from must not matter
            with torch.device("meta" if mode == "meta" else "cpu"):
                model = GPT(**args)
            planned = plan(model, open_weights(path), init_map, strict)  # before the wrap
            if mode != "whole":
                wrap(model, env, DDPConfig(wrapper=Wrapper.fsdp2, meta_init=mode == "meta"))
                assert all(p.to_local().numel() < p.numel() for p in model.parameters())
            apply(model, planned, distributed=True)  # collective
            state = {k: full(v) for k, v in model.state_dict().items()}  # collective
            diff = max((state[k] - expected[k]).abs().max().item() for k in planned.pairs)
            assert all(v.isfinite().all() for v in state.values())  # the rest initialised
            results[f"{mode} {name}"] = (planned.line(), diff)
    return results
