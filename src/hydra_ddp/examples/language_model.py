"""Dict batches and a model that computes its own loss, the Hugging Face way, in plain torch.

`TextSnippets` yields variable-length snippets of CPython's pydoc topics as `{"input_ids",
"labels"}`; `pad_collate` pads a batch and adds an `attention_mask`, with `labels = -100` at
padding (ignored by the loss and the metrics). `TinyCausalLM` returns `.loss` and `.logits` as a
`transformers` model does: `experiment=dict_lm` trains it with `loss=model_output`.
`experiment=dict_lm_transformers` trains a tiny randomly initialised `transformers` GPT-2
(`tiny_gpt2`; needs `pip install -e ".[transformers]"`), nothing downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from hydra_ddp.data import CharText


class TextSnippets(Dataset):
    """Snippets of 16 to `max_len` characters of a split of the pydoc text, one token id per
    character, deterministic per item. `labels`: the next characters, or with `shifted=false`
    the input ids themselves (the Hugging Face convention, where the model shifts)."""

    def __init__(
        self, split: str, max_len: int = 48, snippets: int = 512, shifted: bool = True
    ) -> None:
        # The characters of `data=text` (CharText), its last tenth held out as val and test.
        source = CharText(block_size=1, val_fraction=0.05, test_fraction=0.05)
        self.vocab_size = source.spec["vocab_size"]
        self.text = torch.from_numpy(source.streams[split].astype(np.int64))
        self.max_len, self.snippets, self.shifted = max_len, snippets, shifted

    def __len__(self) -> int:
        return self.snippets

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        length = int(torch.randint(16, self.max_len + 1, (1,), generator=g))
        at = int(torch.randint(0, len(self.text) - length - 1, (1,), generator=g))
        window = self.text[at : at + length + 1]
        if not self.shifted:  # the model shifts (Hugging Face): labels are the inputs
            return {"input_ids": window[:-1], "labels": window[:-1]}
        return {"input_ids": window[:-1], "labels": window[1:]}


def pad_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the longest item: input_ids with 0, labels with -100, and an attention_mask."""
    ids = [item["input_ids"] for item in items]
    labels = [item["labels"] for item in items]
    return {
        "input_ids": pad_sequence(ids, batch_first=True),
        "labels": pad_sequence(labels, batch_first=True, padding_value=-100),
        "attention_mask": pad_sequence([torch.ones_like(i) for i in ids], batch_first=True),
    }


@dataclass
class CausalLMOutput:  # what a Hugging Face causal LM returns, in short
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyCausalLM(nn.Module):
    """A one-layer causal transformer with Hugging Face's calling convention."""

    def __init__(self, vocab_size: int, width: int = 64, heads: int = 4, max_len: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_len, width)
        self.block = nn.TransformerEncoderLayer(width, heads, 4 * width, 0.0, batch_first=True)
        self.head = nn.Linear(width, vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        t = input_ids.shape[1]
        h = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=h.device), 1)
        padding = None if attention_mask is None else attention_mask == 0
        logits = self.head(self.block(h, src_mask=causal, src_key_padding_mask=padding))
        loss = None
        if labels is not None:  # labels are already the next tokens; -100 is ignored
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return CausalLMOutput(loss=loss, logits=logits)


def tiny_gpt2(vocab_size: int, width: int = 64, layers: int = 1, heads: int = 4, max_len: int = 64):
    """A randomly initialised, tiny `transformers` GPT-2 (no download): the real Hugging Face
    model class, called as `model(**batch)`, returning its own `.loss`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_embd=width, n_layer=layers, n_head=heads, n_positions=max_len
    )
    return GPT2LMHeadModel(config)
