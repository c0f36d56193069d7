"""State that differs between ranks (tests/ is on sys.path): a model with BatchNorm, whose
running statistics each rank updates from its own batches (`model._target_=helpers.rank_state.
BatchNormMLP`), and a callback whose state is its rank's own (`+callbacks.mine._target_=
helpers.rank_state.PerRank`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class BatchNormMLP(nn.Module):
    """Linear, BatchNorm1d, GELU, Linear: the MLP config's arguments (hidden; the rest unused)."""

    def __init__(
        self, in_features: int, out_features: int, hidden: int, depth: int = 1, dropout: float = 0
    ):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.BatchNorm1d(hidden),
            nn.GELU(),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class PerRank:
    """Keeps its rank and the sum of the losses its rank saw; what `load_state_dict` got goes to
    <output dir>/loaded_rank<r>.json at on_train_start (null: nothing was loaded), the state at
    the end to saved_rank<r>.json."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.loaded: dict | None = None

    def on_step_end(self, ctx) -> None:
        self.state = {
            "rank": ctx.rank,
            "steps": self.state.get("steps", 0) + 1,
            "loss_sum": self.state.get("loss_sum", 0.0) + float(ctx.loss),
        }

    def on_train_start(self, ctx) -> None:
        out = Path(ctx.output_dir) / f"loaded_rank{ctx.rank}.json"
        out.write_text(json.dumps(self.loaded))

    def on_train_end(self, ctx) -> None:
        """Also this rank's buffers as the run ended, in buffers_rank<r>.pt."""
        out = Path(ctx.output_dir) / f"saved_rank{ctx.rank}.json"
        out.write_text(json.dumps(self.state))
        buffers = {name: b.detach().clone() for name, b in ctx.model.named_buffers()}
        torch.save(buffers, Path(ctx.output_dir) / f"buffers_rank{ctx.rank}.pt")

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state, self.loaded = dict(state), dict(state)


class RankZeroGradNorm:
    """Logs the first parameter's gradient norm on rank 0 only: under ddp=fsdp2 a DTensor whose
    whole value needs every rank."""

    def on_before_optimizer_step(self, ctx) -> None:
        if ctx.rank == 0:
            ctx.log({"grad/first": next(ctx.model.parameters()).grad.norm()})


class WholeOnRankZero:
    """docs/state_across_ranks.md's recipe: `full_tensor()` on every rank, logged on rank 0."""

    def on_before_optimizer_step(self, ctx) -> None:
        from torch.distributed.tensor import DTensor

        def whole(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        named = ctx.model.named_parameters()
        norms = {n: whole(p.grad.norm()) for n, p in named if p.grad is not None}
        if ctx.rank == 0:
            ctx.log({f"whole/{n}": v for n, v in norms.items()})
