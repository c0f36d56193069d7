"""The optimizers: parameter groups (`optim.param_groups`), several named optimizers (`optim`
without a `_target_`), each schedule's `interval` / `monitor`, and the example schedules; what
each key does: docs/make_it_yours.md ("Optimizers and your own step"), docs/configuration.md.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import math
from typing import Any, Callable, Mapping, Sequence

import torch

from hydra_ddp.errors import UserError, check

log = logging.getLogger(__name__)


def param_groups(model: torch.nn.Module, groups: Sequence[Mapping[str, Any]] = ()) -> list[dict]:
    """Trainable parameters in groups: matrices and embeddings take the optimizer's weight
    decay; biases and norm weights (1-D) take none, as in GPT-2 and most transformer recipes.
    Each of `groups` (`{params: pattern(s), **settings}`) first takes the parameters whose names
    match, with its settings."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return _grouped(named, groups, "optim.param_groups", [])


def _grouped(
    named: list[tuple[str, torch.Tensor]],
    groups: Sequence[Mapping[str, Any]],
    key: str,
    labels: list[str],
) -> list[dict]:
    """The optimizer's `params`; `labels` gets each group's name in the logged learning rates:
    the index of its `param_groups` entry, or `rest` for the parameters in none (the decay split
    of one entry shares its label)."""
    out: list[dict] = []
    left = list(named)
    for i, group in enumerate(groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        if "params" not in group:
            raise UserError(f"{key}[{i}] has no params: give a name pattern, e.g. params: 'head.*'")
        mine, left = _match(left, group["params"])
        if not mine:
            raise UserError(
                f"{key}[{i}].params={group['params']!r} matches no trainable parameter; "
                f"names look like {', '.join(n for n, _ in named[:3])}"
            )
        split = _decay_split([p for _, p in mine], settings)
        out += split
        labels += [str(i)] * len(split)
    rest = [p for _, p in left]
    default = [
        {"params": [p for p in rest if p.ndim >= 2]},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
    ]
    if rest or not out:
        out += default
        labels += ["rest"] * len(default)
    return out


def _decay_split(params: list[torch.Tensor], settings: dict[str, Any]) -> list[dict]:
    if "weight_decay" in settings:  # the group says: all its parameters alike
        return [{"params": params, **settings}]
    split = [
        {"params": [p for p in params if p.ndim >= 2], **settings},
        {"params": [p for p in params if p.ndim < 2], **settings, "weight_decay": 0.0},
    ]
    return [g for g in split if g["params"]]


def _match(
    named: list[tuple[str, torch.Tensor]], patterns: str | Sequence[str]
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    pats = [patterns] if isinstance(patterns, str) else list(patterns)
    hit = [(n, p) for n, p in named if any(fnmatch.fnmatchcase(n, q) for q in pats)]
    return hit, [(n, p) for n, p in named if not any(fnmatch.fnmatchcase(n, q) for q in pats)]


def _timing(sched: dict[str, Any], key: str, metrics: Sequence[str]) -> str:
    """When a schedule steps: `step`, `epoch`, or `val/<metric>` (after each validation, with
    that metric's value). Takes the template's keys `interval` and `monitor` out of the
    scheduler's config `sched` (the rest builds the schedule), checked."""
    interval, monitor = sched.pop("interval", None), sched.pop("monitor", None)
    if interval is not None and interval not in ("step", "epoch"):
        raise UserError(
            f"{key}.interval={interval!r} is not one of step, epoch: step after each "
            "optimizer step (the default) or at each epoch's end"
        )
    if monitor is None:
        return interval or "step"
    if interval is not None:
        raise UserError(
            f"{key}: give interval or monitor, not both: a schedule with a monitor steps after "
            "each validation"
        )
    return f"val/{val_metric(monitor, f'{key}.monitor', metrics)}"


def val_metric(monitor: Any, key: str, metrics: Sequence[str]) -> str:
    """The metric that `monitor` (`val/<name>`, set at `key`) names, one of `metrics`: a name
    the job does not compute fails before training, not after it."""
    name = str(monitor).removeprefix("val/")
    if not str(monitor).startswith("val/") or name not in metrics:
        raise UserError(
            f"{key}={monitor} is not a validation metric of this job: use one of "
            f"{', '.join('val/' + m for m in metrics)} (the loss and the metrics config group)"
        )
    return name


class Optimizers:
    """The job's optimizers by name (one, `default`, for a plain `optim`) and their schedules.

    Checkpointed as `optimizer` and `scheduler`: a single optimizer's state as it always was,
    several as a dict by name."""

    def __init__(
        self,
        optimizers: dict[str, Any],
        schedulers: dict[str, Any],
        group_labels: dict[str, list[str]],
        timings: dict[str, str],
    ) -> None:
        """`group_labels`: by optimizer, the name of each of its param groups in the logged
        learning rates; `timings`: by optimizer, when its schedule steps (`_timing`)."""
        self.optimizers, self.schedulers = optimizers, schedulers
        self.single = list(optimizers) == ["default"]
        self.group_labels, self.timings = group_labels, timings

    @classmethod
    def build(cls, cfg: Mapping[str, Any], scheduler_cfg: Any, model: torch.nn.Module,
              total_steps: int, total_epochs: int | None = None,
              metrics: Sequence[str] = ("loss",)) -> Optimizers:  # fmt: skip
        """`total_epochs`: an epoch-stepped schedule's `total_steps` (default: total_steps);
        `metrics`: the validation metrics a `monitor` may name (default: the loss)."""
        from hydra_ddp.components import build

        labels: dict[str, list[str]] = {}
        timings: dict[str, str] = {}

        def one(key: str, spec: Mapping[str, Any], named: list) -> tuple[Any, Any]:
            spec = dict(spec)
            groups = spec.pop("param_groups", None) or []
            sched = spec.pop("scheduler", None) or scheduler_cfg
            sched_key = f"{key}.scheduler" if sched is not scheduler_cfg else "scheduler"
            sched = dict(sched) if isinstance(sched, Mapping) else sched
            spec.pop("params", None)
            name = key.partition(".")[2] or "default"
            mine = labels.setdefault(name, [])
            opt = build(spec, key, params=_grouped(named, groups, f"{key}.param_groups", mine))
            timing = timings[name] = _timing(sched, sched_key, metrics) if sched else "step"
            by_epoch = timing == "epoch" and total_epochs is not None
            length = total_epochs if by_epoch else total_steps
            return opt, build(sched, sched_key, optimizer=opt, total_steps=length)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if "_target_" in cfg:
            opt, sched = one("optim", cfg, named)
            return cls({"default": opt}, {"default": sched}, labels, timings)
        optimizers, schedulers, left = {}, {}, named
        for name, spec in cfg.items():
            if not isinstance(spec, Mapping) or "params" not in spec:
                raise UserError(
                    f"optim.{name} has no params: with several optimizers each names its "
                    "parameters (params: 'generator.*'), or give optim a _target_"
                )
            mine, left = _match(left, spec["params"])
            if not mine:
                raise UserError(
                    f"optim.{name}.params={spec['params']!r} matches no trainable parameter "
                    "not already taken by an earlier optimizer"
                )
            optimizers[name], schedulers[name] = one(f"optim.{name}", spec, mine)
        if left:
            raise UserError(
                f"trainable parameters in no optimizer: {', '.join(n for n, _ in left[:5])}"
                f"{' ...' if len(left) > 5 else ''}: widen an optim.<name>.params pattern"
            )
        return cls(optimizers, schedulers, labels, timings)

    def step_schedules(self) -> None:
        """After each optimizer step: the schedules stepped by step (the default)."""
        self._step("step")

    def end_epoch(self) -> None:
        """At each epoch's end: the schedules with `interval: epoch`."""
        self._step("epoch")

    def after_validation(self, metrics: Mapping[str, float]) -> None:
        """After each validation (`metrics`: its results, `loss`, `acc`, ...): the schedules
        with a `monitor`, stepped with that metric's value (the same on every rank)."""
        for name, scheduler in self.schedulers.items():
            if self.timings[name].startswith("val/"):
                scheduler.step(metrics[self.timings[name].removeprefix("val/")])

    def _step(self, when: str) -> None:
        for name, scheduler in self.schedulers.items():
            if self.timings[name] == when:
                scheduler.step()

    def learning_rates(self) -> dict[str, float]:
        """Every optimizer's every group's current learning rate, as logged: the one `lr` when
        there is one optimizer with one group (the decay split of a group is one group), else
        `lr/<optimizer>/<group>` (<group>: the index of its `param_groups` entry, or `rest`)."""
        rates: dict[str, float] = {}
        for name, optimizer in self.optimizers.items():
            labels = self.group_labels.get(name, [])
            for i, group in enumerate(optimizer.param_groups):
                label = labels[i] if i < len(labels) else str(i)
                rates.setdefault(f"lr/{name}/{label}", float(group["lr"]))
        if len(rates) == 1:
            return {"lr": next(iter(rates.values()))}
        return rates

    def state_dict(self) -> dict[str, Any]:
        states = {n: o.state_dict() for n, o in self.optimizers.items()}
        return states["default"] if self.single else states

    def scheduler_state(self) -> dict[str, Any]:
        states = {n: s.state_dict() for n, s in self.schedulers.items()}
        return states["default"] if self.single else states

    def load_schedules(self, state: dict[str, Any]) -> None:
        """The schedules' saved state; loaded before the optimizers' (`load_optimizers` then
        applies a changed learning rate to both)."""
        scheds = {"default": state} if self.single else state
        for name, scheduler in self.schedulers.items():
            scheduler.load_state_dict(scheds[name])

    def load_optimizers(
        self, state: dict[str, Any], path: Any, load: Callable[[Any, dict], None] | None = None
    ) -> None:
        """The optimizers' saved state (as `state_dict` gives it), with this job's settings
        applied (load_optimizer_state). `load(optimizer, saved)`: how one is loaded (default
        its load_state_dict; ddp=fsdp2 loads into the shards)."""
        opts = {"default": state} if self.single else state
        missing = sorted(set(self.optimizers) - set(opts))
        if missing or self.single != ("param_groups" in state):
            raise UserError(
                f"{path} holds optimizers {sorted(opts) if not self.single else ['default']}, "
                f"this job has {sorted(self.optimizers)}: resume with the optim it was trained "
                "with, or start from its weights with trainer.init_from=<checkpoint>"
            )
        for name, optimizer in self.optimizers.items():
            load_one = None if load is None else functools.partial(load, optimizer)
            load_optimizer_state(optimizer, self.schedulers[name], opts[name], path, load_one)


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the optimizer's lr over `warmup_steps`, then cosine decay to
    lr * min_lr_ratio at `total_steps`."""
    check(0 <= min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]", min_lr_ratio)
    return _warmup_then(
        optimizer,
        total_steps,
        warmup_steps,
        lambda progress: (
            min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        ),
    )


def warmup_constant(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the optimizer's lr over `warmup_steps`, then constant."""
    return _warmup_then(optimizer, total_steps, warmup_steps, lambda progress: 1.0)


def _warmup_then(optimizer, total_steps, warmup_steps, after) -> torch.optim.lr_scheduler.LambdaLR:
    check(warmup_steps >= 0, "warmup_steps", ">= 0", warmup_steps)
    warmup = min(warmup_steps, max(total_steps - 1, 0))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return after(min((step - warmup) / max(total_steps - warmup, 1), 1.0))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# Keys of a param group that are bookkeeping, not the optimizer's hyperparameters.
_NOT_SETTINGS = {"params", "initial_lr", "lr", "param_names"}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    saved: dict[str, Any],
    path: Any,
    load: Callable[[dict], None] | None = None,
) -> None:
    """Resume the optimizer from a checkpoint's `saved` state, refusing another optimizer in one
    line and applying (and saying so) any changed hyperparameter of this job's config.

    torch's `load_state_dict` would otherwise take the saved hyperparameters silently (a new
    `optim.lr` ignored while the run's config records it) and accept another optimizer's state
    (AdamW's into SGD), failing later mid-step with `KeyError: 'momentum'`."""
    configured = [
        {k: v for k, v in g.items() if k not in _NOT_SETTINGS} for g in optimizer.param_groups
    ]
    base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    groups = saved.get("param_groups", [])
    mine, theirs = set(configured[0]) if configured else set(), set()
    for g in groups:
        theirs |= set(g) - _NOT_SETTINGS
    kind = type(optimizer).__name__
    if len(groups) != len(configured) or (theirs and theirs != mine):
        only_theirs = ", ".join(sorted(theirs - mine)) or "-"
        only_mine = ", ".join(sorted(mine - theirs)) or "-"
        raise UserError(
            f"{path} holds the state of another optimizer or parameter grouping than this "
            f"job's optim ({kind}; settings only the checkpoint has: {only_theirs}; only this "
            f"job's: {only_mine}; {len(groups)} vs {len(configured)} group(s)): resume with the "
            "optim it was trained with, or start from its weights with "
            "trainer.init_from=<checkpoint> (fresh optimizer and schedule)"
        )
    (load or optimizer.load_state_dict)(saved)
    changes: dict[str, tuple[Any, Any]] = {}
    for i, (group, want) in enumerate(zip(optimizer.param_groups, configured)):
        for key, value in want.items():
            if group.get(key) != value:
                changes.setdefault(key, (group.get(key), value))
                group[key] = value
        old_base = group.get("initial_lr", group["lr"])
        if old_base != base_lrs[i]:
            changes.setdefault("lr", (old_base, base_lrs[i]))
            group["lr"] = group["lr"] * base_lrs[i] / old_base if old_base else base_lrs[i]
            group["initial_lr"] = base_lrs[i]
    if "lr" in changes and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = list(base_lrs)
    for key, (old, new) in changes.items():
        log.warning(
            "optim.%s %s -> %s (changed since %s) applied to all parameter groups",
            key,
            old,
            new,
            path,
        )
