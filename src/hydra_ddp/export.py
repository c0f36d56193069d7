"""Write a run's checkpoint as one plain file of its weights: what a ddp=fsdp2 run's sharded
checkpoints (folders of every rank's shards) become for use anywhere.

    python -m hydra_ddp.export run=outputs/2026-12-02/08-00-00              # newest checkpoint
    python -m hydra_ddp.export run=<dir> ckpt=best                          # or ckpt=<path>
    python -m hydra_ddp.export run=<dir> out=weights.pt

The file (default `<run>/export/<checkpoint name>.pt`) is a `torch.save` dict: `model` (the
whole state_dict, CPU tensors, the keys of the model's own `state_dict()`), `step`, and `ema`
when the run kept one. `python -m hydra_ddp.eval run=<dir> ckpt=<file>`, `trainer.init_from=
<file>` and plain PyTorch (`model.load_state_dict(torch.load(f)["model"])`) read it. No process
group is needed: DCP assembles every tensor from the shards, on any machine that sees them.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from hydra_ddp import checkpoint
from hydra_ddp.errors import UserError, exit_code
from hydra_ddp.loop.evaluation import Request, checkpoint_file

log = logging.getLogger("hydra_ddp.export")

USAGE = "usage: python -m hydra_ddp.export run=<run dir> [ckpt=last|best|<path>] [out=<file>]"


def export(run: Path, ckpt: str = "last", out: Path | None = None) -> Path:
    """Write the checkpoint `ckpt` of `run` as one file; return its path."""
    if not Path(run).is_dir():
        raise UserError(f"run={run}: no such directory; give a training run's output dir")
    path = checkpoint_file(Request(run=Path(run), ckpt=ckpt))
    state = checkpoint.load(path, key="ckpt")
    plain = {"model": state["model"], "step": int(state["step"])}
    if "ema" in state:
        plain["ema"] = state["ema"]
    out = Path(out) if out else Path(run) / "export" / f"{path.name.split('.')[0]}.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        torch.save(plain, tmp)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"could not write {out} ({checkpoint.write_error(e, out.parent)}): "
            "give another out=<file>"
        ) from e
    count = sum(t.numel() for t in plain["model"].values())
    log.info("%s (step %d, %d tensors, %d values) -> %s", path, plain["step"],
             len(plain["model"]), count, out)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(name)s][%(levelname)s] - %(message)s")
    try:
        args: dict[str, str] = {}
        for arg in sys.argv[1:] if argv is None else argv:
            key, eq, value = arg.partition("=")
            if not eq or key not in ("run", "ckpt", "out"):
                raise UserError(f"{arg!r} is not run=, ckpt= or out=. {USAGE}")
            args[key] = value
        if "run" not in args:
            raise UserError(f"run=<run dir> is missing. {USAGE}")
        out = args.get("out")
        export(Path(args["run"]), args.get("ckpt", "last"), Path(out) if out else None)
    except Exception as e:
        sys.exit(exit_code(e, log))


if __name__ == "__main__":
    main()
