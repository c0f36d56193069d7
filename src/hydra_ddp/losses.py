"""Example losses, chosen with `loss=<name>`. Any callable is a loss (what it is given and
returns: docs/make_it_yours.md, "Any batch, any output, any loss")."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from hydra_ddp.errors import UserError, check


class CrossEntropy(nn.Module):
    """Mean cross-entropy over every position, classes on the last axis: (B, C) logits with
    (B,) targets for classification, (B, T, V) with (B, T) for next-token prediction. Computed
    in float32 even under bf16/fp16 autocast."""

    def __init__(self, label_smoothing: float):
        super().__init__()
        check(0 <= label_smoothing < 1, "label_smoothing", "in [0, 1)", label_smoothing)
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            target.reshape(-1),
            label_smoothing=self.label_smoothing,
        )


class ModelOutput:
    """`loss=model_output`: the loss the model computed itself, `output.loss` or
    `output["loss"]` (a Hugging Face model given `labels`)."""

    def __call__(self, output: Any) -> torch.Tensor:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is None:
            raise UserError(
                f"loss=model_output, but the model returned a {type(output).__name__} without "
                "a loss (output.loss or output['loss']): give the batch its labels, or pick a "
                "loss that computes it from the output"
            )
        return loss
