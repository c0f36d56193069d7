"""Hooks for what a researcher adds to a run without editing the loop.

`callbacks` in the config is a dict of components, empty by default:

    python -m hydra_ddp.train +callbacks.count._target_=my_callbacks.Count +callbacks.count.every=5

The contract (the hooks in `HOOKS`, when each runs, on which ranks, what is checkpointed) is
`hydra_ddp.protocols.Callback`; how ctx.log logs a DTensor whole under ddp=fsdp2:
docs/state_across_ranks.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from hydra_ddp.components import build
from hydra_ddp.distributed import DistEnv, all_gather_objects
from hydra_ddp.errors import UserError, first_line

log = logging.getLogger(__name__)

HOOKS = (
    "on_train_start",
    "on_before_optimizer_step",
    "on_step_end",
    "on_eval_end",
    "on_epoch_end",
    "on_train_end",
)
_MEMBERS = "checkpoint_members"  # not a hook of the loop: asked once, when the job is built


@dataclass
class Context:
    """What a callback's hook is given: where the loop is, the model, and `log`. `model` is the
    unwrapped module: under DDP a forward in a hook starts no collective; under ddp=fsdp2 every
    forward gathers the sharded parameters, so run it on every rank."""

    rank: int
    world_size: int
    model: torch.nn.Module
    output_dir: Path
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch being trained (on_epoch_end: the one that just ended)
    loss: float | torch.Tensor = float("nan")  # the last step's mean loss (a device tensor)
    metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation's
    # on_before_optimizer_step: the optimizer about to step (`default`, or its key under `optim`)
    optimizer: str | None = None
    # on_step_end only, so the loop keeps no step's tensors past the call; `outputs` are
    # detached, and empty for a step of your own that does not call tools.backward.
    batch: list[Any] | None = None
    outputs: list[Any] | None = None
    losses: dict[str, torch.Tensor] | None = None
    # ctx.log's destination: Tracker.log_values.
    _sink: Callable[[int, dict[str, Any]], None] | None = None
    # The DTensors given to ctx.log in the running hook call: logged whole at its end.
    _dtensors: list[tuple[str, Any]] = field(default_factory=list)

    def log(self, values: Mapping[str, Any]) -> None:
        """Record `values` in this rank's stats and sinks at the current step (what each
        accepts: tracking/sink.py). A DTensor is logged whole at the end of the hook call, which
        makes it a collective: log it on every rank."""
        if self._sink is None:
            return
        values = dict(values)
        dtensors = {k: v for k, v in values.items() if isinstance(v, DTensor)}
        self._dtensors.extend(dtensors.items())
        plain = {k: v for k, v in values.items() if k not in dtensors}
        if plain:
            self._sink(self.step, plain)


class Callbacks:
    """The configured callbacks, called in config order; `state_dict` holds theirs by name."""

    def __init__(self, configs: Mapping[str, Any], **runtime: Any) -> None:
        """`runtime`: what a callback may ask for by name in its constructor (`data`)."""
        self.items = {name: build(c, f"callbacks.{name}", **runtime) for name, c in configs.items()}
        for name, cb in self.items.items():
            if not any(callable(getattr(cb, hook, None)) for hook in (*HOOKS, _MEMBERS)):
                raise UserError(
                    f"callbacks.{name} ({type(cb).__name__}) has none of the callback methods "
                    f"{', '.join((*HOOKS, _MEMBERS))}: define at least one"
                )

    def has(self, hook: str) -> bool:
        """Whether any callback defines `hook` (else the loop skips the work it needs)."""
        return any(callable(getattr(cb, hook, None)) for cb in self.items.values())

    def before_step(
        self, ctx: Context, where: Callable[[], tuple[int, int]]
    ) -> Callable[[str], None] | None:
        """StepTools.before_step: on_before_optimizer_step at `where()` (the step being taken,
        the epoch), given the optimizer's name; None when no callback has it (it costs
        nothing)."""
        if not self.has("on_before_optimizer_step"):
            return None

        def call(optimizer: str) -> None:
            ctx.step, ctx.epoch = where()
            ctx.optimizer = optimizer
            try:
                self("on_before_optimizer_step", ctx)
            finally:
                ctx.optimizer = None

        return call

    def __call__(self, hook: str, ctx: Context) -> None:
        """Call `hook` of every callback that has it; `# collective` for a sharded job."""
        dtensors: list[tuple[str, str, Any]] = []  # (callback, key, value)
        called = False
        for name, cb in self.items.items():
            method = getattr(cb, hook, None)
            if method is None:
                continue
            called = True
            ctx._dtensors.clear()
            try:
                method(ctx)
                dtensors += [(name, key, value) for key, value in ctx._dtensors]
            except UserError:
                raise
            except Exception as e:
                raise self._failed(name, hook, ctx.step, e) from e
            finally:
                ctx._dtensors.clear()
        if called:
            self._log_whole(hook, ctx, dtensors)  # collective when sharded

    def _failed(self, name: str, hook: str, step: int, e: Exception) -> UserError:
        # The traceback still goes to the rank's log (the entry logs the cause).
        cb = self.items[name]
        return UserError(
            f"callbacks.{name} ({type(cb).__module__}.{type(cb).__qualname__}) failed "
            f"in {hook} at step {step}: {type(e).__name__}: {first_line(e)}"
        )

    def _log_whole(self, hook: str, ctx: Context, dtensors: list[tuple[str, str, Any]]) -> None:
        """`# collective` when the model is sharded (fully_shard makes it an FSDPModule on every
        rank, also on one): the ranks agree on the DTensors logged, then log `full_tensor()` of
        each. Unsharded, a DTensor replicated on every rank is logged as it is, any other
        refused."""
        if not isinstance(ctx.model, FSDPModule):
            for name, key, value in dtensors:
                if not all(isinstance(p, Replicate) for p in value.placements):
                    raise UserError(_whole_only(name, key, hook))
                self._log_one(name, hook, ctx, key, value.to_local())
            return
        env = DistEnv(rank=ctx.rank, world_size=ctx.world_size)
        mine = [(name, key) for name, key, _ in dtensors]
        every = all_gather_objects(mine, env)  # collective
        if any(theirs != mine for theirs in every):
            raise UserError(_disagreement(hook, every))
        for name, key, value in dtensors:
            self._log_one(name, hook, ctx, key, value.full_tensor())  # collective

    def _log_one(self, name: str, hook: str, ctx: Context, key: str, value: Any) -> None:
        try:
            if ctx._sink is not None:
                ctx._sink(ctx.step, {key: value})
        except ValueError as e:
            raise self._failed(name, hook, ctx.step, e) from e

    def checkpoint_members(self) -> list[Any]:
        """Every callback's `checkpoint_members()` (checkpoint.state.Member), in config order."""
        return [
            member
            for cb in self.items.values()
            if callable(getattr(cb, "checkpoint_members", None))
            for member in cb.checkpoint_members()
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            name: cb.state_dict()
            for name, cb in self.items.items()
            if callable(getattr(cb, "state_dict", None))
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, cb in self.items.items():
            if name in state and callable(getattr(cb, "load_state_dict", None)):
                cb.load_state_dict(state[name])


def _whole_only(name: str, key: str, hook: str) -> str:
    return (
        f"callbacks.{name}: ctx.log value {key!r} in {hook} is a DTensor this rank holds only "
        "part of, outside a sharded job: call .full_tensor() on it on every rank and log that"
    )


def _disagreement(hook: str, every: list[list[tuple[str, str]]]) -> str:
    """One line: the first DTensor logged on some ranks but not all (or in another order)."""
    for entries in every:
        for name, key in entries:
            ranks = [r for r, theirs in enumerate(every) if (name, key) in theirs]
            if len(ranks) < len(every):
                return (
                    f"callbacks.{name}: ctx.log value {key!r} in {hook} is a DTensor (ddp=fsdp2: "
                    f"each rank holds a part), logged on rank(s) {ranks} of {len(every)}: its "
                    "whole value needs every rank, so log it on every rank (then check ctx.rank "
                    "elsewhere), or call .full_tensor() on it on every rank and log the result "
                    "where you like"
                )
    name = every[0][0][0]
    return (
        f"callbacks.{name}: the DTensors given to ctx.log in {hook} came in a different order on "
        "different ranks: log them in the same order on every rank (ddp=fsdp2 gathers each)"
    )


class SampleText:
    """Example callback (experiment=text_gpt): after each validation, every rank samples the
    same `length` characters from the model (under ddp=fsdp2 each forward gathers the
    parameters from all ranks), and rank 0 logs them. It asks for the data source by name to
    turn tokens back into characters; its own generator leaves the training RNG unchanged."""

    def __init__(self, data: Any, length: int = 200, temperature: float = 0.8, seed: int = 0):
        if not hasattr(data, "decode"):
            raise UserError(
                f"callbacks.sample_text needs a text data set with decode() (data=text), "
                f"not {type(data).__name__}"
            )
        self.data, self.length, self.temperature, self.seed = data, length, temperature, seed

    @torch.no_grad()
    def on_eval_end(self, ctx: Context) -> None:
        model = ctx.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(self.seed + ctx.step)
        tokens = torch.zeros((1, 1), dtype=torch.long, device=device)
        for _ in range(self.length):
            logits = model(tokens[:, -self.data.block :])[:, -1, :] / self.temperature
            probs = torch.softmax(logits.float(), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], 1)
        model.train(was_training)
        if ctx.rank != 0:
            return
        text = self.data.decode(tokens[0, 1:].tolist())
        log.info("sample at step %d:\n%s", ctx.step, text)
        ctx.log({"sample": text})
