"""The collectives the loop and a user's loss use: each a no-op (or the identity) without a
process group, so one process runs the same code as many.
"""

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from hydra_ddp.distributed.env import DistEnv
from hydra_ddp.errors import UserError


# Numbers go through a tensor collective, not all_gather_object: under NCCL that would pickle,
# copy to the device and back, and add a size exchange before every gather.
def all_gather_floats(values: list[float], env: DistEnv) -> list[list[float]]:
    """Every rank's `values` (same length on all ranks), indexed by rank."""
    if not env.distributed:
        return [list(map(float, values))]
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    out = [torch.zeros_like(t) for _ in range(env.world_size)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def all_gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's picklable `obj`, indexed by rank."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its own slice, summed over
    the ranks' losses (each rank's loss used every slice)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(ctx.world)]
        dist.all_gather(parts, tensor.contiguous(), group=group)  # collective
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Rank r's loss depends on every slice: the gradient of slice k is the sum over ranks
        # of their gradients for it. An all-reduce (gloo has no reduce-scatter on CPU), then
        # this rank's slice.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # collective
        return grad.chunk(ctx.world)[ctx.rank], None


def all_gather_with_grad(
    tensor: torch.Tensor, group: Any = None, check_shapes: bool = True
) -> torch.Tensor:
    """Collective: every rank's `tensor` concatenated along dim 0 in rank order, differentiable:
    each rank's slice gets the sum of every rank's gradient for it, so with DDP's average the
    step is the gradient of the mean of the ranks' losses (hydra_ddp/examples/contrastive.py).
    Without a process group: the tensor itself.

    Every rank must pass the same shape, as training and evaluation batches are.
    `check_shapes` agrees the shapes first (one small collective and a host sync) and raises
    one line naming them on every rank, where gloo would abort a rank with its error on stderr
    only.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    if check_shapes:
        _same_shapes(tensor, group)  # collective
    return _AllGatherWithGrad.apply(tensor, group)


# The ranks whose current evaluation batch is padding (data/view.py), set by the
# evaluation around each batch's loss and metrics; None outside evaluation.
_padded: Sequence[bool] | None = None


@contextlib.contextmanager
def evaluation_batch(padded: Sequence[bool] | None) -> Iterator[None]:
    """Within: `gather_for_metrics` leaves out the ranks whose batch is padding (`padded`)."""
    global _padded
    before, _padded = _padded, padded
    try:
        yield
    finally:
        _padded = before


def gather_for_metrics(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Collective: `all_gather_with_grad`, less the rows of ranks whose evaluation batch is
    padding (data/view.py): every real row of the global batch once, the same on every
    rank. What a metric with `gathers = True` calls."""
    gathered = all_gather_with_grad(tensor, group)  # collective
    if _padded is None or not any(_padded) or gathered is tensor:
        return gathered
    slices = gathered.split(len(tensor))
    return torch.cat([s for s, pad in zip(slices, _padded) if not pad])


def _same_shapes(tensor: torch.Tensor, group: Any) -> None:
    world = dist.get_world_size(group)
    # The number of dimensions first: shapes of different lengths cannot be gathered as one.
    shape = torch.tensor([tensor.dim(), *tensor.shape, *[-1] * (8 - tensor.dim())][:9],
                         device=tensor.device)  # fmt: skip
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)  # collective
    seen = [tuple(s[1 : 1 + int(s[0])].tolist()) for s in shapes]
    if len(set(seen)) > 1:
        raise UserError(
            "all_gather_with_grad: the ranks hold tensors of different shapes ("
            + ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(seen))
            + "); every rank must gather the same shape (the batches of training and "
            "evaluation have the same size on every rank: gather the batch's rows)"
        )


def sum_by_name(sums: dict[str, list[float]], env: DistEnv) -> dict[str, list[float]]:
    """Element-wise sums over ranks of named lists; a name some ranks lack counts as zeros."""
    merged: dict[str, list[float]] = {}
    for part in all_gather_objects(sums, env):
        for name, values in part.items():
            merged[name] = (
                [a + b for a, b in zip(merged[name], values)] if name in merged else list(values)
            )
    return merged
