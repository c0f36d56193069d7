"""A gather with gradients (`hydra_ddp.distributed.all_gather_with_grad`) and the contrastive
example
built on it (`experiment=contrastive`: NT-Xent with negatives from every rank). The gradient
each rank gets equals a one-process reference; trained on 2 gloo ranks, the first loss is
ln(2·world·batch − 1) and evaluation works, also with a loss that gathers over uneven
evaluation shards (every rank evaluates the same batches); different shapes stop every rank with
one line naming them, instead of gloo aborting one rank with its error on stderr only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import FAST
from helpers import ranks
from helpers.inproc import train_ranks

from hydra_ddp.distributed import DistEnv, all_gather_with_grad
from hydra_ddp.errors import UserError
from hydra_ddp.examples.contrastive import nt_xent


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2 * 6, 5, dtype=torch.float64, generator=g)  # 6 rows a rank, 2 ranks


def _rank_loss(mine: torch.Tensor, everyone: torch.Tensor, rank: int) -> torch.Tensor:
    """A loss that uses every rank's rows, and this rank's own differently."""
    return (mine.sin() @ everyone.T).square().mean() * (rank + 1) + everyone.cos().sum()


def _grad_on_rank(env: DistEnv) -> tuple[torch.Tensor, torch.Tensor]:
    x = _inputs().chunk(env.world_size)[env.rank].clone().requires_grad_()
    gathered = all_gather_with_grad(x)
    _rank_loss(x, gathered, env.rank).backward()
    return gathered.detach(), x.grad


def test_the_gradient_of_each_slice_equals_a_one_process_reference() -> None:
    results = ranks.run(_grad_on_rank, world_size=2, timeout=60)
    everyone = _inputs().requires_grad_()
    parts = everyone.chunk(2)
    # What DDP's average then makes the mean of: every rank's loss, summed.
    sum(_rank_loss(parts[r], everyone, r) for r in range(2)).backward()
    for rank, (gathered, grad) in enumerate(results):
        assert torch.equal(gathered, _inputs())
        assert torch.allclose(grad, everyone.grad.chunk(2)[rank], rtol=1e-12, atol=1e-12)
    # Without a process group: the tensor itself, gradients untouched.
    x = torch.ones(3, requires_grad=True)
    assert all_gather_with_grad(x) is x


def _uneven(env: DistEnv) -> torch.Tensor:
    return all_gather_with_grad(torch.zeros(3 + env.rank, 2))


def test_different_shapes_stop_every_rank_in_one_line_naming_them() -> None:
    results = ranks.run(_uneven, world_size=2, timeout=60, return_exceptions=True)
    for r in results:
        assert isinstance(r, UserError), r
        assert "rank 0: [3, 2], rank 1: [4, 2]" in str(r) and "the same size" in str(r)


def test_no_gather_outside_training() -> None:
    a = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    model = torch.nn.Linear(1, 1).eval()  # as evaluation hands it: eval mode
    loss = nt_xent({"a": a, "b": a.clone()}, model, temperature=0.5)
    assert torch.isfinite(loss) and loss < math.log(2 * 4 - 1)  # positives are identical


def test_contrastive_example_on_two_ranks(tmp_path: Path) -> None:
    batch = 16
    s = train_ranks(tmp_path / "job", *FAST, "experiment=contrastive", "trainer.max_steps=12",
                    "trainer.log_interval=1", f"trainer.batch_size={batch}")[0]  # fmt: skip
    assert s["world_size"] == 2 and s["steps"] == 12
    for rank in (0, 1):
        lines = (tmp_path / "job" / "stats" / f"rank{rank}.jsonl").read_text().splitlines()
        losses = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
        # Near-uniform similarities at initialisation: every other view of the global batch
        # is equally likely, 2·world·batch − 1 of them.
        assert losses[0] == pytest.approx(math.log(2 * 2 * batch - 1), rel=0.02), losses
        assert min(losses[-3:]) < losses[0], "it learns"
    # Evaluation with the rank's own negatives (uneven shards: no collective in the loss).
    assert math.isfinite(s["val_loss"]) and s["val_loss"] < math.log(2 * batch - 1) + 0.05
    # A loss that gathers in evaluation too: the test split's shards are uneven (test_fraction
    # 0.1655 of digits' 1,797 rows: 297 rows, 149 and 148), yet every rank evaluates the same
    # batches (the last one padding on rank 1), so the gathers pair up: no gloo abort, no
    # mismatched shapes. Every split gets the fraction, so the three are cut alike.
    uneven = [f"+data.{split}.test_fraction=0.1655" for split in ("train", "val", "test")]
    gathered = train_ranks(tmp_path / "gathers", *FAST, "experiment=contrastive", *uneven,
                           "trainer.max_steps=2", f"trainer.batch_size={batch}",
                           "loss._target_=helpers.contrastive_user.gathers_always")  # fmt: skip
    assert gathered[0]["rows_held_per_rank"] == [1230, 1230]  # 1,797 - 270 val - 297 test
    for r in gathered:
        assert math.isfinite(r["val_loss"]) and math.isfinite(r["test_loss"]), r
        assert r["test_loss"] == gathered[0]["test_loss"]


def _mismatched_collective(env: DistEnv) -> None:
    """A plain torch all_gather whose sizes differ between the ranks, inside the template's
    process group: gloo aborts the rank that receives more than it expected."""
    import torch.distributed as dist

    from hydra_ddp.config import DistConfig
    from hydra_ddp.distributed import process_group

    with process_group(env, DistConfig(timeout_s=20)):
        mine = torch.zeros(2 + 2 * env.rank)
        dist.all_gather([torch.empty_like(mine) for _ in range(env.world_size)], mine)
        dist.barrier()


@pytest.mark.slow  # fresh workers: the dead rank's pool cannot be reused
def test_a_rank_that_dies_in_a_collective_leaves_the_call_in_its_log() -> None:
    with pytest.raises(ranks.RankFailed) as died:
        ranks.run(_mismatched_collective, world_size=2, group=False, timeout=60, fresh=True)
    logs = "".join(died.value.logs)
    assert "Fatal Python error: Aborted" in logs, died.value
    assert "_mismatched_collective" in logs, logs  # the collective's line, in the rank's log
