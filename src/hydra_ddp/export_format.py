"""An export folder, read back with torch, safetensors and the model's own class: nothing of the
training template (no Hydra, no config schema, no process group).

    model.safetensors  the weights; tied tensors stored once (safetensors.torch.save_model)
    config.json        {"hydra_ddp": {...where it came from...}, "model": {"_target_": ...,
                       its arguments}, "spec": what the data gave the model (vocab_size, ...),
                       "vocabulary": "vocab.json" or null}
    vocab.json         the data's tokens by id, where the data has a vocabulary
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from hydra_ddp.errors import UserError

WEIGHTS, CONFIG, VOCAB = "model.safetensors", "config.json", "vocab.json"
MARK = "hydra_ddp"  # config.json's entry that makes a folder an export of this template


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json of an export folder, checked: every file it needs is there."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(
            f"{folder}: no such folder; give an export folder (python -m hydra_ddp.export "
            "run=<run dir> writes <run dir>/export/<name>/)"
        )
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise UserError(
            f"{folder} has no {CONFIG}: not an export folder, or a copy cut short; export "
            "the run again (python -m hydra_ddp.export run=<run dir>)"
        ) from None
    except (OSError, ValueError) as e:
        raise UserError(f"{folder / CONFIG} is not readable JSON ({e}): export again") from None
    if not isinstance(config, dict) or MARK not in config or "model" not in config:
        raise UserError(
            f"{folder / CONFIG} is not an export's config (no {MARK}/model entries); a Hugging "
            "Face folder loads with transformers' from_pretrained"
        )
    wanted = [WEIGHTS] + ([config["vocabulary"]] if config.get("vocabulary") else [])
    for name in wanted:
        if not (folder / name).is_file():
            raise UserError(
                f"{folder} is an export folder missing {name} (a copy cut short?): copy the "
                "whole folder, or export the run again (python -m hydra_ddp.export run=<dir>)"
            )
    return config


def load(folder: str | Path, device: str | torch.device = "cpu", strict: bool = True):
    """The exported model, rebuilt from its class and arguments and loaded (strict: every
    tensor, no more), in eval mode."""
    config = read_config(folder)
    model = build_target(config["model"], config.get("spec") or {})
    load_model(model, str(Path(folder) / WEIGHTS), strict=strict, device=str(device))
    return model.to(device).eval()


def read_state(folder: str | Path) -> dict[str, Any]:
    """The export as a checkpoint's `{"model": state_dict, "step": step}`, tied tensors under
    each of their names again (save_model's metadata names the one each was stored as): for
    `python -m hydra_ddp.eval ckpt=<export folder>`."""
    config = read_config(folder)
    file = str(Path(folder) / WEIGHTS)
    state = load_file(file)
    with safe_open(file, framework="pt") as f:
        stored_as = f.metadata() or {}
    state.update({k: state[v] for k, v in stored_as.items() if v in state and k not in state})
    return {"model": state, "step": int(config[MARK].get("step", 0))}


@dataclass
class Vocabulary:
    """The data's tokens by id: text to ids and back."""

    tokens: list[str]

    def __post_init__(self) -> None:
        self._ids = {t: i for i, t in enumerate(self.tokens)}

    def encode(self, text: str) -> list[int]:
        """One id per character (the text example's vocabulary is characters)."""
        unknown = sorted({c for c in text if c not in self._ids})
        if unknown:
            raise UserError(f"{unknown[:5]} not in the vocabulary ({len(self.tokens)} tokens)")
        return [self._ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.tokens[i] for i in ids)


def vocabulary(folder: str | Path) -> Vocabulary:
    """The exported data's vocabulary (an export of data that has one)."""
    config = read_config(folder)
    if not config.get("vocabulary"):
        raise UserError(f"{folder}: the exported run's data has no vocabulary")
    data = json.loads((Path(folder) / config["vocabulary"]).read_text())
    return Vocabulary(list(data["tokens"]))


def build_target(spec_or_args: dict[str, Any], spec: dict[str, Any]) -> Any:
    """`{"_target_": "pkg.mod.Class", **arguments}` called, nested `_target_`s first, with the
    data's `spec` entries its signature takes and the arguments leave out (what the template's
    components.build does at training)."""
    args = {
        k: build_target(v, {}) if isinstance(v, dict) and "_target_" in v else v
        for k, v in spec_or_args.items()
        if k != "_target_"
    }
    module, _, name = spec_or_args["_target_"].rpartition(".")
    target = getattr(importlib.import_module(module), name)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    args.update({k: v for k, v in spec.items() if k in params and k not in args})
    return target(**args)
