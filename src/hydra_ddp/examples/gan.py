"""A GAN on two ranks: two optimizers, alternating steps, and a step of its own.

The data are 2-D points on a ring of 8 Gaussians (`RingPoints`). `GAN` holds the generator and
the discriminator; its forward computes one phase's loss (`phase="d"`: discriminator on real
and generated points; `"g"`: generator through the discriminator), so each phase is one forward
and one backward through the DDP wrapper. `gan_step` alternates them with the template's
helpers (`tools.backward`, `tools.step`), so mixed precision, accumulation, clipping and the
non-finite check still apply. `experiment=gan`: `optim=gan` names one optimizer per network,
and `ddp=unused_params` lets DDP skip the network a phase does not train."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


class RingPoints(Dataset):
    def __init__(self, rows: int = 2048, seed: int = 0, noise: float = 0.05) -> None:
        g = torch.Generator().manual_seed(seed)
        angle = torch.randint(0, 8, (rows,), generator=g) * (2 * math.pi / 8)
        centres = torch.stack([angle.cos(), angle.sin()], dim=1) * 2
        self.points = centres + noise * torch.randn(rows, 2, generator=g)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (self.points[i],)


def _mlp(inp: int, out: int, width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inp, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, out))  # fmt: skip


class GAN(nn.Module):
    def __init__(self, noise_dim: int = 8, width: int = 64) -> None:
        super().__init__()
        self.noise_dim = noise_dim
        self.generator = _mlp(noise_dim, 2, width)
        self.discriminator = _mlp(2, 1, width)

    def forward(self, real: torch.Tensor, phase: str = "d") -> dict[str, torch.Tensor]:
        z = torch.randn(len(real), self.noise_dim, device=real.device)
        if phase == "g":
            fake_logits = self.discriminator(self.generator(z))
            loss = F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits))
            return {"loss": loss}
        with torch.no_grad():
            fake = self.generator(z)
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake)
        loss = F.binary_cross_entropy_with_logits(
            real_logits, torch.ones_like(real_logits)
        ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
        return {"loss": loss}


def gan_step(tools: Any, model: nn.Module, micro_batches: list, objective: Any,
             optimizers: dict) -> dict[str, torch.Tensor]:  # fmt: skip
    """Discriminator step, then generator step, on the same real batches. `objective` is the
    job's loss (`loss=model_output`: the forward's own)."""
    d = tools.backward(model, micro_batches, objective)
    tools.step(optimizers["discriminator"])
    g = tools.backward(Phase(model, "g"), micro_batches, objective)
    tools.step(optimizers["generator"])
    return {"loss": d["loss"] + g["loss"], "d": d["loss"], "g": g["loss"]}


class Phase:
    """The DDP-wrapped GAN called with a phase, for `tools.backward`."""

    def __init__(self, model: nn.Module, phase: str) -> None:
        self.model, self.phase = model, phase

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.model(*inputs, phase=self.phase)

    def __getattr__(self, name: str) -> Any:
        # zero_grad, and what the template's step.no_sync looks for: DDP's no_sync(), FSDP2's
        # set_requires_gradient_sync (an FSDP2 model has no no_sync), neither when unwrapped.
        return getattr(self.model, name)
