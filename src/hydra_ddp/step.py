"""The training step: `default_step` (unless `step._target_` or the model's `training_step`
replaces it), written with the loop's `StepTools`. Nothing in it reads a value back from the
device unless `skip_non_finite` asks for it: on a GPU every such read stalls the launch queue
until the device catches up, so the loop checks the step's health later (`NonFiniteCheck`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from hydra_ddp.batches import BatchLoss, forward
from hydra_ddp.config import NanPolicy, Precision
from hydra_ddp.distributed import DistEnv, all_gather_floats
from hydra_ddp.distributed.failures import unused_parameters
from hydra_ddp.errors import UserError

log = logging.getLogger(__name__)


def autocast_for(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's autocast context: none at all in fp32 (nanoGPT's idiom)."""
    if precision == Precision.fp32:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == Precision.bf16 else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def scaler_for(precision: Precision, device: torch.device) -> torch.amp.GradScaler:
    """fp16's loss scaler; disabled (a no-op) otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == Precision.fp16)


class StepTools:
    """The template's step machinery, as helpers for a step of your own (`step._target_`):
    mixed precision, `no_sync()` gradient accumulation, unscale-then-clip, skipping a step with
    non-finite gradients (`default_step` shows their use; the loop calls `update()` after).

    `max_norm` (trainer.grad_clip) is one threshold for every optimizer, or a map of optimizer
    name -> threshold (one it leaves out is not clipped); `optimizers` names the job's.
    """

    def __init__(
        self,
        scaler: torch.amp.GradScaler,
        autocast: contextlib.AbstractContextManager,
        max_norm: float | Mapping[str, float],
        skip_non_finite: bool = True,
        raw_model: torch.nn.Module | None = None,
        optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    ) -> None:
        self.scaler, self.autocast, self.max_norm = scaler, autocast, max_norm
        self.skip_non_finite, self.raw_model = skip_non_finite, raw_model
        # By identity: the step is handed the optimizer objects, not their names.
        self._names = {id(o): n for n, o in (optimizers or {}).items()}
        if isinstance(max_norm, Mapping) and optimizers is not None:
            unknown = sorted(set(max_norm) - set(optimizers))
            if unknown:
                raise UserError(
                    f"trainer.grad_clip.{unknown[0]}: no optimizer is named {unknown[0]!r}; "
                    f"the optimizers are {', '.join(optimizers)}"
                )
        self.grad_norms: list[torch.Tensor] = []  # of this step's `step` calls
        # Set by the loop for the callbacks: `before_step(name)` runs in `step` with the
        # gradients present; with `keep_outputs`, `backward` keeps each micro-batch's output,
        # detached, in `outputs` for on_step_end (the loop empties it).
        self.before_step: Callable[[str], None] | None = None
        self.keep_outputs = False
        self.outputs: list[Any] = []

    def clip_for(self, optimizer: torch.optim.Optimizer) -> float:
        """The clip threshold of `optimizer` (0: not clipped)."""
        if not isinstance(self.max_norm, Mapping):
            return float(self.max_norm or 0.0)
        name = self._names.get(id(optimizer))
        if name is None:
            raise UserError(
                "trainer.grad_clip is a map by optimizer name, but this optimizer is none of "
                f"the job's ({', '.join(self._names.values()) or 'none given'}): step the "
                "optimizers the step function is handed"
            )
        return float(self.max_norm.get(name, 0.0) or 0.0)

    def backward(
        self, model: torch.nn.Module, micro_batches: Sequence[Any], objective: Callable
    ) -> dict[str, torch.Tensor]:
        """Forward and backward over `micro_batches`, gradients accumulated (synced on the last
        one only). `objective(output, batch, model) -> (loss, extras)` (a batches.BatchLoss, or
        a plain `loss(output, target)`). Returns the mean `loss` and extras, on the device."""
        if not isinstance(objective, BatchLoss):
            objective = BatchLoss(objective)
        model.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        n = len(micro_batches)
        for i, batch in enumerate(micro_batches):
            last = i == n - 1
            with contextlib.nullcontext() if last else no_sync(model):
                with self.autocast:
                    output = _forward(model, batch)
                    loss, extras = objective(output, batch, self.raw_model)
                if self.keep_outputs:
                    self.outputs.append(_detached(output))
                del output  # not held through the backward (a language model's logits)
                self.scaler.scale(loss / n).backward()
            for name, value in {"loss": loss.detach(), **extras}.items():
                totals[name] = value / n if name not in totals else totals[name] + value / n
        return totals

    def step(
        self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Unscale (fp16), run `before_step` (the callbacks), clip `parameters` (default: the
        optimizer's) to `clip_for(optimizer)`, step unless the norm is non-finite (with
        `skip_non_finite`), zero the gradients. Returns the norm before clipping."""
        if parameters is None:
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
        if self.before_step is not None:
            self.before_step(self._names.get(id(optimizer), "default"))
        max_norm = self.clip_for(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm or math.inf)
        if isinstance(grad_norm, DTensor):  # ddp=fsdp2: the global norm, on every rank
            grad_norm = grad_norm.full_tensor()
        # The norm is the same on every rank (gradients are averaged by now), so all ranks skip
        # the same steps. Reading it is the one host sync: only with skip_non_finite.
        if self.scaler.is_enabled() or not self.skip_non_finite or torch.isfinite(grad_norm):
            self.scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.grad_norms.append(grad_norm)
        return grad_norm

    def update(self) -> torch.Tensor:
        """After the step: the fp16 scaler's update; returns the gradient norm of all the step's
        `step` calls together."""
        self.scaler.update()
        norms, self.grad_norms = self.grad_norms, []
        if len(norms) == 1:
            return norms[0]
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _forward(model: Any, batch: Any) -> Any:
    """The model's forward; DDP's refusal of parameters that got no gradient in the previous
    step (raised here, at the next forward) names those parameters."""
    try:
        return forward(model, batch)
    except RuntimeError as e:
        if "Expected to have finished reduction" not in str(e):
            raise
        names = _unused_parameter_names(model, str(e))
        if not names:
            raise
        raise unused_parameters(names) from e


def _detached(output: Any) -> Any:
    """A model's output without its autograd graph: a tensor, or a dict / list / tuple of them
    (other values as they are)."""
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, Mapping):
        return {k: _detached(v) for k, v in output.items()}
    if type(output) in (list, tuple):  # not a namedtuple: its constructor takes fields
        return type(output)(_detached(v) for v in output)
    return output


def _unused_parameter_names(model: Any, message: str) -> list[str]:
    """DDP lists the indices of the parameters that got no gradient on this rank, counted over
    the module's parameters that require one."""
    found = re.search(r"did not receive grad for rank \d+:\s*([\d ]+)", message)
    module = getattr(model, "module", None)
    if found is None or not isinstance(module, torch.nn.Module):
        return []
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    indices = [int(i) for i in found.group(1).split()]
    return [trainable[i] for i in indices if i < len(trainable)]


@contextlib.contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """Accumulate this micro-batch's gradients without syncing them: DDP's `no_sync()`, FSDP2's
    `set_requires_gradient_sync(False)` (it has no `no_sync`), nothing for an unwrapped model."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def default_step(
    tools: StepTools,
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    objective: Callable,
    optimizers: dict[str, torch.optim.Optimizer],
) -> dict[str, torch.Tensor]:
    """The step the loop runs unless `step._target_` names another (`hydra_ddp.protocols.Step`):
    one backward over the micro-batches, then every optimizer steps. Returns `loss` and extras."""
    losses = tools.backward(model, micro_batches, objective)
    for optimizer in optimizers.values():
        tools.step(optimizer)
    return losses


def train_step(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    autocast: contextlib.AbstractContextManager,
    max_norm: float,
    skip_non_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`default_step` and the scaler's update as one call with plain arguments, for the
    benchmarks and tests that run a step without the loop. Returns the mean loss and the
    gradient norm before clipping, both left on the device."""
    tools = StepTools(scaler, autocast, max_norm, skip_non_finite)
    losses = default_step(tools, model, micro_batches, loss_fn, {"default": optimizer})
    return losses["loss"], tools.update()


class NonFiniteCheck:
    """trainer.nan_policy without a host sync per step: `observe` keeps, on the device, the
    first step whose gradient norm and the first whose loss went non-finite; `check`
    (collective) reads them at a step every rank reaches and stops or warns."""

    _NONE = 2**62

    def __init__(self, env: DistEnv, policy: NanPolicy) -> None:
        self.env, self.policy = env, policy
        self._first = torch.full((2,), self._NONE, dtype=torch.long, device=env.device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        finite = torch.stack([torch.isfinite(grad_norm), torch.isfinite(loss)])
        torch.minimum(self._first, torch.where(finite, self._NONE, step), out=self._first)

    def check(self) -> None:
        """Collective: raise (nan_policy=stop) or log the skipped step (skip)."""
        firsts = all_gather_floats(self._first.tolist(), self.env)
        self._first.fill_(self._NONE)
        step = int(min(min(f) for f in firsts))
        if step >= self._NONE:
            return
        ranks = [r for r, (_, loss_step) in enumerate(firsts) if int(loss_step) == step]
        if ranks:
            what = f"non-finite loss at step {step} on rank(s) {', '.join(map(str, ranks))}"
        else:
            what = (
                f"non-finite gradients at step {step} on every rank (the loss was finite on all "
                "ranks; the averaged gradient overflowed)"
            )
        if self.policy == NanPolicy.stop:
            raise UserError(
                f"{what}: lower optim.lr, enable trainer.grad_clip, check the data those "
                "ranks read, or set trainer.nan_policy=skip to drop such steps"
            )
        log.warning("skipping step %d (trainer.nan_policy=skip): %s", step, what)
