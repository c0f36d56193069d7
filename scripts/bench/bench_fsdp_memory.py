"""Per-rank training state of ddp=fsdp2 against DDP, for the example GPT at growing width.

    python scripts/bench/bench_fsdp_memory.py                       # 2 and 4 ranks, gloo, CPU
    python scripts/bench/bench_fsdp_memory.py --ranks 2 --widths 256 512

Each configuration runs on real gloo ranks (torch.multiprocessing): the GPT is built (on the
meta device for fsdp2, so no rank ever holds the whole model), wrapped as the template wraps it
(`hydra_ddp.distributed.ddp.wrap_model`), and trained for two AdamW steps. Then every rank reports

- state: its bytes of parameters + gradients + optimizer state
  (`hydra_ddp.distributed.fsdp.state_bytes`,
  the `state_bytes_per_rank` of summary.json), next to the analytic figure: 16 bytes per
  parameter for fp32 AdamW (4 weight + 4 gradient + 8 moments), divided by N under fsdp2;
- rss: the growth of its peak resident memory over what it held before building the model
  (activations and communication buffers included, so above the state).

Results go in docs/benchmarks.md with the exact command and the machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hydra_ddp.config import DDPConfig, Wrapper  # noqa: E402
from hydra_ddp.distributed import DistEnv  # noqa: E402
from hydra_ddp.distributed.ddp import wrap_model  # noqa: E402
from hydra_ddp.distributed.fsdp import state_bytes  # noqa: E402
from hydra_ddp.models import GPT  # noqa: E402

VOCAB, BLOCK, LAYERS, HEADS = 256, 64, 4, 4


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rank(rank: int, world: int, port: int, wrapper: str, width: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, launched=True)
    before = _peak_rss()
    sharded = wrapper == "fsdp2"
    cfg = DDPConfig(wrapper=Wrapper(wrapper), meta_init=sharded)
    torch.manual_seed(0)
    with torch.device("meta") if sharded else torch.device("cpu"):
        model = GPT(VOCAB, BLOCK, LAYERS, HEADS, width, 0.0)
    params = sum(p.numel() for p in model.parameters())
    wrapped, _ = wrap_model(model, env, cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randint(0, VOCAB, (2, BLOCK))
        logits = wrapped(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mine = state_bytes(model, [optimizer])
    out[(wrapper, world, width, rank)] = (params, mine, _peak_rss() - before)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(rank: int, world: int, port: int, wrapper: str, width: int, out: dict) -> None:
    _rank(rank, world, port, wrapper, width, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args(argv)
    manager = mp.Manager()
    out = manager.dict()
    print("| ranks | width | params | wrapper | state/rank MiB | analytic MiB | fsdp2/ddp "
          "| peak RSS growth/rank MiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        for width in args.widths:
            ddp_state = None
            for wrapper in ("ddp", "fsdp2"):
                mp.spawn(_launch, args=(world, _free_port(), wrapper, width, out), nprocs=world)
                rows = [out[(wrapper, world, width, r)] for r in range(world)]
                params = rows[0][0]
                state = max(r[1] for r in rows)
                rss = max(r[2] for r in rows)
                analytic = 16 * params / (world if wrapper == "fsdp2" else 1)
                ddp_state = state if wrapper == "ddp" else ddp_state
                print(
                    f"| {world} | {width} | {params / 1e6:.1f}M | {wrapper} | "
                    f"{state / 2**20:.1f} | {analytic / 2**20:.1f} | "
                    f"{state / ddp_state:.3f} | {rss / 2**20:.0f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
