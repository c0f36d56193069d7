"""What the checker's runs record, and how two records compare.

`Probe` is the callback the checker adds to each of its runs (docs/check.md says what it
records), writing into the checker's dir; it has no `state_dict`: no checkpoint holds anything
of it. The functions below it compare what two runs left: checkpoints entry by entry, tensors
and numbers exactly or within a tolerance `tol` relative to one plus their magnitude.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hydra_ddp.batches import to_device
from hydra_ddp.config import Precision
from hydra_ddp.data import EvalData
from hydra_ddp.distributed import DistEnv
from hydra_ddp.distributed.fsdp import full

# Steps this long make the ranks look for a stop signal at every boundary, so the stop lands
# on the step asked for.
from hydra_ddp.distributed.preemption import CHECK_EVERY_S
from hydra_ddp.loop.scoring import predict
from hydra_ddp.step import autocast_for


class Probe:
    """`stop_at`: SIGTERM to this process after that step (0: none); `grads_at`: keep that
    step's inputs and gradients (1 or 0); `predict`: predict the validation split at the end,
    batched as evaluation does (`sampler`, `batch_size`, `precision`: the job's)."""

    def __init__(self, out: str, data: Any, stop_at: int = 0, grads_at: int = 0,
                 predict: bool = False, sampler: Any = None, batch_size: int = 1,
                 precision: Any = "fp32") -> None:  # fmt: skip
        self.out, self.data, self.stop_at, self.grads_at = Path(out), data, stop_at, grads_at
        self.predict, self.sampler, self.batch_size = predict, sampler, batch_size
        self.precision = Precision(getattr(precision, "value", precision))

    def on_train_start(self, ctx: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.grads_at == ctx.step + 1:
            state = {name: _whole(t) for name, t in ctx.model.state_dict().items()}
            rng = {"torch": torch.get_rng_state()}
            if _device(ctx.model).type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(_device(ctx.model))
            torch.save({"rng": rng, "state": state if ctx.rank == 0 else None},
                       self.out / f"start_rank{ctx.rank}.pt")  # fmt: skip

    def on_before_optimizer_step(self, ctx: Any) -> None:
        path = self.out / f"grads_rank{ctx.rank}.pt"
        if ctx.step == self.grads_at and not path.exists():  # one backward, several optimizers
            grads = {n: p.grad for n, p in ctx.model.named_parameters() if p.requires_grad}
            torch.save({n: None if g is None else _whole(g) for n, g in grads.items()}, path)

    def on_step_end(self, ctx: Any) -> None:
        line = {"step": ctx.step, "epoch": ctx.epoch, "loss": float(ctx.loss),
                "rows": [row_digests(b) for b in ctx.batch or []],
                "attrs": plain_attributes(ctx.model)}  # fmt: skip
        with open(self.out / f"rank{ctx.rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if ctx.step == self.grads_at:
            batch = [to_device(b, torch.device("cpu")) for b in ctx.batch or []]
            torch.save(batch, self.out / f"batch_rank{ctx.rank}.pt")
        if ctx.step < self.stop_at:
            time.sleep(CHECK_EVERY_S)
        elif ctx.step == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, ctx: Any) -> None:
        apart = disagreement(ctx.model)  # collective
        if ctx.rank == 0:
            (self.out / "agreement.json").write_text(json.dumps(apart))
        if self.predict:  # the model as saved: the last checkpoint comes before on_train_end
            env = DistEnv(rank=ctx.rank, world_size=ctx.world_size, device=_device(ctx.model))
            split = EvalData(self.data, "val", self.sampler, env, self.batch_size)
            ctx.model.eval()
            autocast = autocast_for(self.precision, env.device)
            predict(ctx.model, split, env, autocast, self.out / "predictions_val.pt")  # collective
            ctx.model.train()


def row_digests(batch: Any) -> list[str]:
    """A short digest of each row of `batch` (every tensor with its row dimension)."""
    tensors = leaves(batch)
    rows = next((t.shape[0] for t in tensors if t.dim()), 0)
    parts = [t.detach().cpu().contiguous().reshape(rows, -1).view(torch.uint8).numpy()
             for t in tensors if t.dim() and t.shape[0] == rows and t.numel()]  # fmt: skip
    whole = np.concatenate(parts, axis=1) if parts else []
    return [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in whole]


def plain_attributes(model: torch.nn.Module) -> dict[str, Any]:
    """Every module's public attributes that are numbers, strings or tensors but neither
    parameters nor buffers (`calls`): what a model may change that no checkpoint holds."""
    found = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            key = f"{prefix}.{name}".lstrip(".")
            if name.startswith("_") or name == "training":
                continue
            if isinstance(value, (bool, int, float, str)):
                found[key] = value
            elif isinstance(value, torch.Tensor):
                raw = _whole(value).contiguous().reshape(-1).view(torch.uint8).numpy()
                found[key] = hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()
    return found


def disagreement(model: torch.nn.Module) -> dict[str, float]:
    """`# collective`: for each parameter and buffer, the largest difference between ranks."""
    apart = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        high = _whole(tensor).to(_device(model)).double()
        low = high.clone()
        if dist.is_initialized():
            dist.all_reduce(high, op=dist.ReduceOp.MAX)  # collective
            dist.all_reduce(low, op=dist.ReduceOp.MIN)  # collective
        apart[name] = float((high - low).abs().max()) if high.numel() else 0.0
    return apart


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy; a DTensor (ddp=fsdp2) gathered whole (`# collective`)."""
    return full(tensor).detach().cpu().clone()


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


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
