"""Device placement, checked without a GPU: every shipped metric's sums, the losses, the
evaluation's per-rank sums, the step with EMA and the non-finite check run with the model and
the batches on `meta` (a device every torch build has, which refuses to mix with CPU tensors the
way CUDA does), and again on `cuda` where one exists. A CPU tensor created in a device path
fails here, in CI, instead of on a user's first GPU run.

Also: host-device syncs in the step (none unless nan_policy=skip), and a user's metric or loss
that mixes devices gets one line naming it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hydra_ddp.config import NanPolicy
from hydra_ddp.distributed import DistEnv
from hydra_ddp.errors import UserError
from hydra_ddp.loop.scoring import score
from hydra_ddp.loop.wrapping import EMA
from hydra_ddp.losses import CrossEntropy
from hydra_ddp.metrics import (
    Accuracy,
    BitsPerToken,
    MeanSquaredError,
    Perplexity,
    R2Score,
)
from hydra_ddp.models import GPT, MLP
from hydra_ddp.optim import param_groups
from hydra_ddp.step import NonFiniteCheck, train_step

DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def _classification(device: torch.device, n: int = 8, classes: int = 3):
    return torch.randn(n, classes, device=device), torch.randint(0, classes, (n,), device=device)


def _tokens(device: torch.device):
    return torch.randn(2, 5, 7, device=device), torch.randint(0, 7, (2, 5), device=device)


def _regression(device: torch.device):
    return torch.randn(8, 1, device=device), torch.randn(8, 1, device=device)


@pytest.mark.parametrize(
    "metric, data",
    [
        (Accuracy(), _classification),
        (Perplexity(), _tokens),
        (BitsPerToken(), _tokens),
        (MeanSquaredError(), _regression),
        (R2Score(), _regression),
    ],
    ids=["accuracy", "perplexity", "bits_per_token", "mse", "r2"],
)
def test_every_metric_sums_on_the_outputs_device(metric, data, device) -> None:
    output, target = data(device)
    sums = metric.sums(output, target)
    assert sums.device.type == device.type and sums.dtype == torch.float64 and sums.dim() == 1


@pytest.mark.parametrize(
    "loss, data",
    [(CrossEntropy(label_smoothing=0.1), _classification), (torch.nn.MSELoss(), _regression),
     (torch.nn.HuberLoss(), _regression)],
)  # fmt: skip
def test_every_loss_stays_on_the_device(loss, data, device) -> None:
    output, target = data(device)
    assert loss(output, target).device.type == device.type


def test_evaluation_sums_stay_on_the_device(device) -> None:
    model = MLP(in_features=4, out_features=3, hidden=8, depth=1, dropout=0.0).to(device)
    # Batches as a DataLoader yields them: on the CPU; evaluation moves them.
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(3)]
    metrics = {"acc": Accuracy(), "ppl": Perplexity()}
    sums = score(model, batches, device, CrossEntropy(0.0), metrics, contextlib.nullcontext())
    assert set(sums) == {"loss", "acc", "ppl"}
    assert all(s.device.type == device.type for s in sums.values())


def test_text_model_evaluation_on_the_device(device) -> None:
    model = GPT(vocab_size=7, block_size=5, n_layer=1, n_head=1, n_embd=8, dropout=0.0)
    batches = [(torch.randint(0, 7, (2, 5)), torch.randint(0, 7, (2, 5)))]
    metrics = {"ppl": Perplexity(), "bpc": BitsPerToken(), "acc": Accuracy()}
    sums = score(model.to(device), batches, device, CrossEntropy(0.0), metrics,
                 contextlib.nullcontext())  # fmt: skip
    assert all(s.device.type == device.type for s in sums.values())


def test_the_step_with_ema_and_the_health_check_stay_on_the_device(device) -> None:
    model = MLP(in_features=4, out_features=3, hidden=8, depth=2, dropout=0.0).to(device)
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-3, foreach=False)
    scaler = torch.amp.GradScaler(device.type if device.type == "cuda" else "cpu", enabled=False)
    ema = EMA(model, decay=0.9)
    health = NonFiniteCheck(DistEnv(device=device), NanPolicy.stop)
    x, y = torch.randn(6, 4, device=device), torch.randint(0, 3, (6,), device=device)
    for step in range(1, 3):
        loss, norm = train_step(
            model, [(x[:3], y[:3]), (x[3:], y[3:])], CrossEntropy(0.0), optimizer, scaler,
            contextlib.nullcontext(), max_norm=1.0, skip_non_finite=False,
        )  # fmt: skip
        ema.update(model)
        health.observe(step, loss, norm)
        assert loss.device.type == norm.device.type == device.type
    assert ema.n_averaged == 2
    assert all(p.device.type == device.type for p in ema.module.parameters())


class _MixesDevices:
    def sums(self, output, target):
        return torch.stack([output.sum().double(), torch.tensor(1.0, dtype=torch.float64)])

    def compute(self, totals):
        return totals[0]


def test_a_metric_that_mixes_devices_is_named_in_one_line() -> None:
    model = MLP(in_features=4, out_features=3, hidden=8, depth=1, dropout=0.0).to("meta")
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,)))]
    bad = r"metrics\.bad \(test_device_placement\._MixesDevices\) mixes "
    with pytest.raises(UserError, match=bad):
        score(model, batches, torch.device("meta"), CrossEntropy(0.0), {"bad": _MixesDevices()},
              contextlib.nullcontext())  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_in_the_step_on_cuda() -> None:
    device = torch.device("cuda")
    model = MLP(in_features=4, out_features=3, hidden=8, depth=2, dropout=0.0).to(device)
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    ema = EMA(model, decay=0.9)
    health = NonFiniteCheck(DistEnv(device=device), NanPolicy.stop)
    x, y = torch.randn(6, 4, device=device), torch.randint(0, 3, (6,), device=device)
    ema.update(model)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            loss, norm = train_step(
                model, [(x, y)], CrossEntropy(0.0), optimizer, scaler, contextlib.nullcontext(),
                1.0, skip_non_finite=False,
            )  # fmt: skip
            ema.update(model)
            health.observe(step, loss, norm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
