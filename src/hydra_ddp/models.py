"""Models, each built as `cls(cfg, spec)` from its config and the data's `DataSpec`.

Every model returns logits; `loss_and_correct` turns them into a loss plus, for classifiers,
the number of right answers, so the loop and evaluation need no per-model branches.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from hydra.utils import get_class

from hydra_ddp.config import CNNConfig, GPTConfig, MLPConfig, ModelConfig
from hydra_ddp.data import DataSpec, Task
from hydra_ddp.errors import UserError


class MLP(nn.Module):
    tasks = (Task.classification,)

    def __init__(self, cfg: MLPConfig, spec: DataSpec):
        super().__init__()
        layers: list[nn.Module] = []
        width = spec.in_features
        for _ in range(cfg.depth):
            layers += [nn.Linear(width, cfg.hidden), nn.GELU(), nn.Dropout(cfg.dropout)]
            width = cfg.hidden
        layers.append(nn.Linear(width, spec.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """Two 3x3 conv layers and a small classifier: enough for 8x8 digits."""

    tasks = (Task.classification,)

    def __init__(self, cfg: CNNConfig, spec: DataSpec):
        super().__init__()
        if spec.image_shape is None:
            raise UserError("model=cnn needs image data (data=digits); this data set has no "
                            "image shape: use model=mlp")
        c, h, w = spec.image_shape
        self.shape = spec.image_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, cfg.channels, 3, padding=1), nn.GELU(),
            nn.Conv2d(cfg.channels, 2 * cfg.channels, 3, padding=1), nn.GELU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(cfg.dropout),
            nn.Linear(2 * cfg.channels * (h // 2) * (w // 2), cfg.hidden), nn.GELU(),
            nn.Dropout(cfg.dropout), nn.Linear(cfg.hidden, spec.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, *self.shape)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # is_causal instead of a mask buffer: no buffer for DDP to broadcast every forward.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT-style character model (nanoGPT's shape: pre-norm blocks, tied embeddings)."""

    tasks = (Task.language_model,)

    def __init__(self, cfg: GPTConfig, spec: DataSpec):
        super().__init__()
        self.block_size = spec.block_size
        self.tok = nn.Embedding(spec.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(spec.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, spec.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled init of the residual projections keeps activations bounded.
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    """Build the class named by model._target_, refusing a model that cannot fit the data."""
    try:
        cls = get_class(cfg._target_)
    except Exception as e:
        raise UserError(f"model._target_={cfg._target_!r} cannot be imported: {e}") from e
    tasks = getattr(cls, "tasks", None)
    if tasks is not None and spec.task not in tasks:
        hint = "model=gpt" if spec.task == Task.language_model else "model=mlp or model=cnn"
        raise UserError(f"model {cls.__name__} does not fit a {spec.task.value} data set: "
                        f"use {hint}")
    return cls(cfg, spec)


def train_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all positions (no argmax: training never reads it)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def loss_and_correct(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and the count of correct argmax predictions (all positions)."""
    flat_logits, flat_y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
    loss = train_loss(logits, y)
    correct = (flat_logits.argmax(-1) == flat_y).sum()
    return loss, correct
