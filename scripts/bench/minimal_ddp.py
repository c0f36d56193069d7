"""A hand-written minimal DDP loop: the baseline that bench_speed.py holds hydra_ddp to.

    torchrun --standalone --nproc_per_node=2 scripts/bench/minimal_ddp.py --epochs 40

The same work per step as `hydra_ddp.train` with its default config (model=mlp, data=digits,
optim=adamw, scheduler=cosine, loss=cross_entropy, fp32, grad_clip 1.0), written out in plain
torch (no hydra_ddp import): the MLP of model=mlp (64 -> 256 -> 256 -> 10, GELU, dropout 0.1),
the digits train split cut as hydra_ddp.data.Digits cuts it, 64 samples per rank per step,
fused AdamW(lr 2e-3, betas (0.9, 0.999), weight decay 0.01) with the same two parameter groups
(matrices decay, biases do not), the same linear-warmup (20 steps) + cosine (to 0.1 x lr)
LambdaLR over the run's steps, clip_grad_norm_(1.0) every step, gloo. A plain torch DataLoader
over a TensorDataset with a DistributedSampler. No logging, evaluation or checkpoint.

Rank 0 prints `MINIMAL_DDP_SKIP` when step --skip is done and, at the end, one JSON line:
wall-clock times (time.time()) of the first step, of every 10th step with the samples trained
so far, and of the loop's start and end.
"""

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=40)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--skip", type=int, default=20, help="steps left out of the steady-state rate")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

# hydra_ddp.data.Digits: x / 16 as float32, a seeded permutation, 15% val, 15% test, rest train.
bunch = load_digits()
x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)
order = np.random.default_rng(0).permutation(len(x))
train = order[round(len(x) * 0.15) + round(len(x) * 0.15) :]
dataset = TensorDataset(torch.from_numpy(x[train]), torch.from_numpy(y[train]))
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

torch.manual_seed(0)
layers, width = [], 64  # hydra_ddp.models.MLP with hidden 256, depth 2, dropout 0.1
for _ in range(2):
    layers += [nn.Linear(width, 256), nn.GELU(), nn.Dropout(0.1)]
    width = 256
model = DDP(nn.Sequential(*layers, nn.Linear(width, 10)))
params = list(model.parameters())
opt = torch.optim.AdamW(
    [
        {"params": [q for q in params if q.ndim >= 2]},
        {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0},
    ],
    lr=2e-3,
    betas=(0.9, 0.999),
    weight_decay=0.01,
    fused=True,
)
total_steps = args.epochs * len(loader)
warmup = min(20, total_steps - 1)


def lr_factor(s: int) -> float:  # hydra_ddp.optim.warmup_cosine(warmup_steps=20, min_lr_ratio=0.1)
    if s < warmup:
        return (s + 1) / (warmup + 1)
    progress = min((s - warmup) / max(total_steps - warmup, 1), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
loss_fn = nn.CrossEntropyLoss()

step, samples, marks = 0, 0, {"every10": []}
t_loop = time.time()
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        loss = loss_fn(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        samples += len(xb)
        if step == 1:
            marks["first_step"] = time.time()
        if step % 10 == 0:
            marks["every10"].append((step, time.time(), samples))
            if step == args.skip and rank == 0:
                print("MINIMAL_DDP_SKIP", flush=True)
t_end = time.time()
if rank == 0:
    print(
        "MINIMAL_DDP "
        + json.dumps(
            {
                **marks,
                "loop_start": t_loop,
                "loop_end": t_end,
                "steps": step,
                "samples_per_rank": samples,
                "world_size": world,
            }
        ),
        flush=True,
    )
dist.barrier()  # without it gloo often aborts at exit (terminate called ...) on torch 2.13
dist.destroy_process_group()
