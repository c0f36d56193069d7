"""What the checker records inside each of its training runs: a callback it adds with
`+callbacks.hydra_ddp_check._target_=hydra_ddp.check.probe.Probe`, writing into the check's
own dir (`out`), never into the run's.

Every rank appends one JSON line per step to `rank<r>.jsonl`: the loss, a digest of every row
each micro-batch held, and the model's plain attributes (state that no checkpoint holds). On
request it also keeps the parameters, the RNG, the batch and the gradients of one step (for the
gradient check), stops the run after a step as SIGTERM would (for the resume check), and at the
end measures how far the ranks' tensors are apart and predicts the validation split (for the
rank-agreement and checkpoint checks). It has no `state_dict`: a checkpoint holds nothing of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

# How often the ranks look for a stop signal (in rank 0's step time): steps at least this long
# make them look at every step boundary, so a stop lands on the step asked for.
from hydra_ddp.distributed.preemption import _CHECK_EVERY_S


class Probe:
    """The checker's callback. `stop_at`: send this process SIGTERM after that step (0: never);
    `grads_at`: keep the state, batch and gradients of that step (0: none, 1: the first step of
    a fresh run); `predict`: predict the validation split at the end with `sampler`'s rows."""

    def __init__(
        self,
        out: str,
        data: Any,
        sampler: Any = None,
        batch_size: int = 1,
        precision: Any = "fp32",
        stop_at: int = 0,
        grads_at: int = 0,
        predict: bool = False,
    ) -> None:
        self.out, self.data, self.sampler = Path(out), data, sampler
        self.batch_size, self.precision = batch_size, getattr(precision, "value", precision)
        self.stop_at, self.grads_at, self.predict = stop_at, grads_at, predict
        self._grads_kept = False

    def on_train_start(self, ctx: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.grads_at == ctx.step + 1:
            state = {name: _whole(t) for name, t in ctx.model.state_dict().items()}
            rng = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available() and _device(ctx.model).type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(_device(ctx.model))
            kept = {"rng": rng, **({"state": state} if ctx.rank == 0 else {})}
            torch.save(kept, self.out / f"start_rank{ctx.rank}.pt")

    def on_before_optimizer_step(self, ctx: Any) -> None:
        if ctx.step != self.grads_at or self._grads_kept:
            return  # several optimizers: the one backward's gradients are all there at the first
        self._grads_kept = True
        grads = {
            name: None if p.grad is None else _whole(p.grad)
            for name, p in ctx.model.named_parameters()
            if p.requires_grad
        }
        torch.save(grads, self.out / f"grads_rank{ctx.rank}.pt")

    def on_step_end(self, ctx: Any) -> None:
        line = {
            "step": ctx.step,
            "epoch": ctx.epoch,
            "loss": float(ctx.loss),
            "rows": [row_digests(batch) for batch in ctx.batch or []],
            "attrs": plain_attributes(ctx.model),
        }
        with open(self.out / f"rank{ctx.rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if ctx.step == self.grads_at:
            batch = [_to_cpu(b) for b in ctx.batch or []]
            torch.save(batch, self.out / f"batch_rank{ctx.rank}.pt")
        if ctx.step < self.stop_at:
            time.sleep(_CHECK_EVERY_S)
        elif ctx.step == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, ctx: Any) -> None:
        apart = disagreement(ctx.model)  # collective
        if ctx.rank == 0:
            (self.out / "agreement.json").write_text(json.dumps(apart))
        if self.predict:
            self._predict(ctx)  # collective

    def _predict(self, ctx: Any) -> None:
        """The validation split's outputs of the model as it was saved (the last checkpoint is
        written before on_train_end), as `hydra_ddp.eval predict=true` writes them."""
        from hydra_ddp.config import Precision
        from hydra_ddp.data import EvalData
        from hydra_ddp.distributed import DistEnv
        from hydra_ddp.loop.predict import predict
        from hydra_ddp.step import autocast_for

        device = _device(ctx.model)
        env = DistEnv(rank=ctx.rank, world_size=ctx.world_size, device=device)
        split = EvalData(self.data, "val", self.sampler, env, self.batch_size)
        was_training = ctx.model.training
        ctx.model.eval()
        autocast = autocast_for(Precision(self.precision), device)
        predict(ctx.model, split, env, autocast, self.out / "predictions_val.pt")  # collective
        ctx.model.train(was_training)


def row_digests(batch: Any) -> list[str]:
    """One short digest per row of `batch` (every tensor with a row dimension, in order): equal
    digests, equal rows."""
    tensors = list(_tensors(batch))
    rows = next((t.shape[0] for t in tensors if t.dim()), 0)
    parts = [
        t.detach().cpu().contiguous().reshape(rows, -1).view(torch.uint8).numpy()
        for t in tensors
        if t.dim() and t.shape[0] == rows and t.numel()
    ]
    if not parts:
        return []
    whole = np.concatenate(parts, axis=1)
    return [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in whole]


def plain_attributes(model: torch.nn.Module) -> dict[str, Any]:
    """Every module's public attributes that are plain values or tensors but neither parameters
    nor buffers (`module.calls`): what the model may change without any checkpoint holding it.
    Tensors by digest."""
    found: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if name.startswith("_") or name == "training":
                continue
            key = f"{prefix}.{name}" if prefix else name
            if isinstance(value, (bool, int, float, str)):
                found[key] = value
            elif isinstance(value, torch.Tensor):
                found[key] = _digest(_whole(value))
    return found


def disagreement(model: torch.nn.Module) -> dict[str, float]:
    """`# collective`: for each parameter and buffer, the largest difference between any two
    ranks' values (0.0: identical everywhere)."""
    apart = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        values = _whole(tensor).to(_device(model)).double()
        high, low = values.clone(), values.clone()
        if dist.is_initialized():
            dist.all_reduce(high, op=dist.ReduceOp.MAX)  # collective
            dist.all_reduce(low, op=dist.ReduceOp.MIN)  # collective
        apart[name] = float((high - low).abs().max()) if values.numel() else 0.0
    return apart


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy; a DTensor (ddp=fsdp2) gathered whole (`# collective`)."""
    full = getattr(tensor, "full_tensor", None)
    tensor = full() if callable(full) else tensor
    return tensor.detach().cpu().clone()


def _device(model: torch.nn.Module) -> torch.device:
    tensor = next(model.parameters(), None)
    if tensor is None:
        return torch.device("cpu")
    with contextlib.suppress(AttributeError):  # a DTensor: where its local shard lives
        tensor = tensor.to_local()
    return tensor.device


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tuple(tensor.shape)}:{hashlib.blake2b(raw, digest_size=8).hexdigest()}"


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def _to_cpu(batch: Any) -> Any:
    from hydra_ddp.batches import to_device

    return to_device(batch, torch.device("cpu"))
