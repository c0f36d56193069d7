"""`python -m hydra_ddp.export`: a run's checkpoint as a folder anyone can load (export_format.py;
the commands and the layout: docs/weights.md). The model is rebuilt on the CPU from the run's
.hydra/config.yaml (a ddp=fsdp2 run's shards assembled by DCP: no GPU, no process group) and
written whole into a temporary folder, then renamed into place."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_model

from hydra_ddp import checkpoint
from hydra_ddp.checkpoint.checkpointer import swap_into_place
from hydra_ddp.checkpoint.state import load_model_state
from hydra_ddp.components import build
from hydra_ddp.disk import why_write_failed
from hydra_ddp.errors import UserError, exit_code
from hydra_ddp.eval import arguments, job_config
from hydra_ddp.export_format import CONFIG, MARK, VOCAB, WEIGHTS

log = logging.getLogger("hydra_ddp.export")

USAGE = (
    "usage: python -m hydra_ddp.export run=<run dir> [ckpt=last|best|<path>] [out=<folder>] "
    "[weights=ema|model] [--format folder|hf]"
)
FORMATS, NAMES = ("folder", "hf"), ("run", "ckpt", "out", "format", "weights")


def export(
    run: Path | str,
    ckpt: str = "last",
    out: Path | str | None = None,
    format: str = "folder",
    weights: str = "ema",
) -> Path:
    """Write the checkpoint `ckpt` of `run` as an export folder; return its path."""
    run = Path(run)
    if not run.is_dir():
        raise UserError(f"run={run}: no such directory; give a training run's output dir")
    path, state = checkpoint.read_picked(run, ckpt)
    cfg = job_config(run, [])
    source = build(cfg.data, "data")
    with torch.device("cpu"):
        model = build(cfg.model, "model", **source.spec)
    use_ema = "ema" in state and weights == "ema"  # what the run evaluated, and what eval loads
    weights_in = checkpoint.model_weights(state, weights)
    load_model_state(model, weights_in, path, hint="or export another checkpoint (ckpt=)")
    out = Path(out) if out else run / "export" / path.name.split(".")[0]
    about = {"run": str(run.resolve()), "checkpoint": str(path.resolve()),
             "step": int(state["step"]), "weights": "ema" if use_ema else "model"}  # fmt: skip
    chars = getattr(source, "chars", None)  # the data's vocabulary, where it has one
    tokens = list(chars) if isinstance(chars, (str, list)) and chars else None
    tmp = _start(out)
    try:
        if format == "hf":
            _hf(model, tmp, about)
        else:
            save_model(model, str(tmp / WEIGHTS), metadata={"format": "pt"})
            config = {
                MARK: about,
                "model": OmegaConf.to_container(OmegaConf.create(dict(cfg.model)), resolve=True),
                "spec": dict(source.spec),
                "vocabulary": VOCAB if tokens else None,
            }
            (tmp / CONFIG).write_text(json.dumps(config, indent=2, default=str) + "\n")
        if tokens:
            (tmp / VOCAB).write_text(json.dumps({"tokens": tokens}, ensure_ascii=False) + "\n")
        # safetensors writes its file for its owner only: an export is for others to load too.
        umask = os.umask(0)
        os.umask(umask)
        for made in tmp.iterdir():
            if made.is_file():
                made.chmod(0o666 & ~umask)
        swap_into_place(tmp, out)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"could not write {out} ({why_write_failed(e, out.parent)[1]}): "
            "give another out=<folder>"
        ) from e
    count = sum(p.numel() for p in model.parameters())
    log.info("%s (step %d, %s, %d parameters) -> %s%s", path, about["step"], about["weights"],
             count, out, " (Hugging Face layout)" if format == "hf" else "")  # fmt: skip
    return out


def _hf(model: torch.nn.Module, folder: Path, about: dict[str, Any]) -> None:
    save_pretrained = getattr(model, "save_pretrained", None)
    if not callable(save_pretrained):
        raise UserError(
            f"--format hf needs a transformers PreTrainedModel; this run's model is "
            f"{type(model).__module__}.{type(model).__qualname__}: export it without --format"
        )
    model.config.hydra_ddp = about  # kept in its config.json: where the weights came from
    save_pretrained(str(folder), safe_serialization=True)


def _start(out: Path) -> Path:
    """A fresh temporary folder beside `out`; refuses an `out` that is not an earlier export."""
    if out.exists() and not (out / CONFIG).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"out={out} exists and is not an export folder: give another out=")
    if (out / CONFIG).is_file() and MARK not in (out / CONFIG).read_text():
        raise UserError(f"out={out} holds another config.json: give another out=")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(name)s][%(levelname)s] - %(message)s")
    try:
        given = [a.removeprefix("--") for a in (sys.argv[1:] if argv is None else argv)]
        if "format" in given[:-1]:  # --format hf; also --format=hf and format=hf
            at = given.index("format")
            given[at : at + 2] = [f"format={given[at + 1]}"]
        args, others = arguments(given, NAMES, USAGE)
        if others:
            raise UserError(
                f"{others[0]!r} is not run=, ckpt=, out=, weights= or --format. {USAGE}"
            )
        if args.get("format", "folder") not in FORMATS:
            raise UserError(f"--format {args['format']}: use folder (default) or hf. {USAGE}")
        if args.get("weights", "ema") not in ("ema", "model"):
            raise UserError(f"weights={args['weights']}: use ema (default) or model. {USAGE}")
        export(**args)
    except Exception as e:
        sys.exit(exit_code(e, log))
