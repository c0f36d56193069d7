"""Example models: plain `nn.Module`s built from `conf/model/<name>.yaml` plus what the data
source's `spec` gives by name (`in_features`, `out_features`, `image_shape`, `vocab_size`,
`block_size`). They return raw outputs (logits, or predictions for regression); the loss and the
metrics are components of their own. A model of yours is any importable `nn.Module`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hydra_ddp.errors import check


class MLP(nn.Module):
    """Flattened input, `depth` hidden layers of width `hidden`, `out_features` outputs."""

    def __init__(
        self, in_features: int, out_features: int, hidden: int, depth: int, dropout: float
    ):
        super().__init__()
        check(hidden > 0, "hidden", "> 0", hidden)
        check(depth >= 1, "depth", ">= 1", depth)
        check(0 <= dropout < 1, "dropout", "in [0, 1)", dropout)
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """Two 3x3 conv layers and a small classifier: enough for 8x8 digits."""

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        out_features: int,
        channels: int,
        hidden: int,
        dropout: float,
    ):
        super().__init__()
        check(channels > 0, "channels", "> 0", channels)
        check(hidden > 0, "hidden", "> 0", hidden)
        check(0 <= dropout < 1, "dropout", "in [0, 1)", dropout)
        c, h, w = image_shape
        self.shape = tuple(image_shape)
        self.features = nn.Sequential(
            nn.Conv2d(c, channels, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.GELU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * channels * (h // 2) * (w // 2), hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, *self.shape)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # is_causal instead of a mask buffer: no buffer for DDP to broadcast every forward.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT-style character model (nanoGPT's shape: pre-norm blocks, tied embeddings)."""

    # ddp=fsdp2 shards each block as a unit of its own (gathered one block at a time); the
    # root keeps the embeddings, the final norm and the tied head.
    fsdp_units = ("Block",)

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float,
    ):
        super().__init__()
        check(n_layer >= 1, "n_layer", ">= 1", n_layer)
        check(n_head >= 1, "n_head", ">= 1", n_head)
        check(
            n_embd > 0 and n_embd % n_head == 0,
            "n_embd",
            f"> 0 and divisible by n_head={n_head}",
            n_embd,
        )
        check(0 <= dropout < 1, "dropout", "in [0, 1)", dropout)
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's initialisation; also what ddp.meta_init runs on each rank's shards."""
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled init of the residual projections keeps activations bounded.
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * len(self.blocks)))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            m.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
