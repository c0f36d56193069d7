"""Reading a finished job's results back in tests: its per-rank losses, the loss over the global
batch, its final weights, and comparing two sets of weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hydra_ddp import checkpoint


def losses(job: Path, rank: int = 0) -> dict[int, float]:
    """Rank `rank`'s training loss at each logged step (none when it has no stats file)."""
    path = job / "stats" / f"rank{rank}.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


def global_losses(job: Path, world: int = 2) -> dict[int, float]:
    """Each step's loss over the global batch: the mean over the ranks that ran it (each rank
    logs the loss of its own rows; a run that changed world size has a file per rank it had)."""
    per_rank = [r for r in (losses(job, rank) for rank in range(world)) if r]
    steps = sorted(set().union(*per_rank))
    return {s: sum(r[s] for r in per_rank if s in r) / sum(s in r for r in per_rank) for s in steps}


def final_weights(job: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(checkpoint.latest(job))["model"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= atol, f"{k}: max diff {diff}"
