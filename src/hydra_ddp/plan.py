"""The memory plan before launch: what each rank will hold, without training.

    python -m hydra_ddp.plan experiment=text_gpt dist.nproc_per_node=8 --device-mem 16GiB
    python -m hydra_ddp.plan model.hidden=4096 trainer.precision=bf16 --ranks 4

Takes the overrides of `python -m hydra_ddp.train`, composed and checked the same way, and
prints one rank's bytes under `ddp` and `ddp=fsdp2` side by side, and the largest
trainer.batch_size whose peak fits --device-mem; no process group, no training (memory.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
from hydra.errors import HydraException

from hydra_ddp import memory
from hydra_ddp.components import build
from hydra_ddp.config import Device, Precision, TrainConfig, Wrapper
from hydra_ddp.errors import UserError, config_error
from hydra_ddp.launch.command import compose_typed

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_ROWS = (
    ("params", "parameters + buffers"),
    ("grads", "gradients"),
    ("optimizer", "optimizer state"),
    ("buckets", "DDP buckets"),
    ("gathered", "fsdp2 gathered units"),
    ("hook_state", "comm hook state"),
    ("workspaces", "CUDA workspaces"),
    ("activations", "activations"),
)


def parse_bytes(text: str) -> int:
    """`16GiB`, `16G`, `16GB` (all 2**30), `512MiB`, or a number of bytes."""
    found = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", text)
    if not found:
        raise UserError(
            f"--device-mem {text!r} is not a size: give e.g. 16GiB, 80G or 512MiB"
        )  # fmt: skip
    size = int(float(found.group(1)) * _UNITS[found.group(2).lower()])
    if size <= 0:
        raise UserError(f"--device-mem {text!r} is no memory: give e.g. 16GiB, 80G or 512MiB")
    return size


def device_memory(given: str | None) -> tuple[int | None, str]:
    """The memory a batch must fit, and where that number came from."""
    if given:
        return parse_bytes(given), "--device-mem"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name}"
    return None, "none given (no GPU visible): pass --device-mem, e.g. --device-mem 16GiB"


def job_device(cfg: TrainConfig) -> str:
    """cuda where the job would train on a GPU here (dist.device, a visible GPU), else cpu."""
    return "cuda" if torch.cuda.is_available() and cfg.dist.device != Device.cpu else "cpu"


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def table(cfg: TrainConfig, counted: memory.Counted, rows: list[memory.MemoryPlan],
          mem: int | None, mem_from: str) -> str:  # fmt: skip
    """The plan as a small table (one column per wrapper)."""
    p = rows[0]
    params = counted.values
    precision = cfg.trainer.precision.value
    if cfg.trainer.precision == Precision.fp32 and cfg.ddp.wrapper == Wrapper.fsdp2:
        precision += f", fsdp2 param_dtype={cfg.ddp.param_dtype.value}"
    lines = [
        f"memory plan per rank: {cfg.model.get('_target_')} ({params / 1e6:.2f}M parameters), "
        f"{p.world_size} rank(s), "
        f"trainer.batch_size={p.batch_size}, precision {precision}, a {job_device(cfg)} job "
        f"(CUDA workspaces only with a GPU visible); counted on the {counted.where} device",
        f"{'':24}" + "".join(f"{r.wrapper:>14}" for r in rows),
    ]
    for key, label in _ROWS:
        lines.append(f"{label:24}" + "".join(f"{mib(getattr(r, key)):>14}" for r in rows))
    lines.append(f"{'peak':24}" + "".join(f"{mib(r.peak):>14}" for r in rows))
    if mem is None:
        lines.append(f"largest trainer.batch_size: device memory {mem_from}")
    else:
        fits = [r.largest_batch(mem) for r in rows]
        cells = "".join(f"{(str(b) if b < sys.maxsize else 'any'):>14}" for b in fits)
        lines.append(f"{'largest batch_size':24}{cells}")
        lines.append(f"(fitting {mib(mem)}, {mem_from}; tensors only: leave room for the CUDA "
                     "context and allocator slack, ~1 GiB)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hydra_ddp.plan", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device-mem", help="memory of one device, e.g. 16GiB (default: GPU 0's)")
    parser.add_argument("--ranks", type=int, help="ranks to plan for (default: the config's)")
    args, overrides = parser.parse_known_args(argv)
    try:
        unknown = [o for o in overrides if o.startswith("-")]
        if unknown:  # Hydra would read it as an override it cannot parse
            raise UserError(f"{unknown[0]} is not an option: the options are --device-mem, --ranks")
        if args.ranks is not None and args.ranks < 1:
            raise UserError(f"--ranks {args.ranks}: give the number of ranks, 1 or more")
        mem, mem_from = device_memory(args.device_mem)
        cfg = compose_typed(None, "train", overrides)
        ranks = args.ranks
        if ranks is None:
            ranks = int(os.environ.get("WORLD_SIZE", cfg.dist.nproc_per_node))
        counted = memory.count(cfg, build(cfg.data, "data"))
        rows = [
            memory.plan_memory(counted, cfg, ranks, w, device=job_device(cfg))
            for w in (Wrapper.ddp, Wrapper.fsdp2)
        ]
    except HydraException as e:  # an override Hydra cannot apply: its own words, on one line
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return 2
    except Exception as e:
        e = config_error(e) or e
        if not isinstance(e, UserError):
            raise
        sys.stderr.write(f"error: {e}\n")
        return 2
    print(table(cfg, counted, rows, mem, mem_from))
    return 0


if __name__ == "__main__":
    sys.exit(main())
