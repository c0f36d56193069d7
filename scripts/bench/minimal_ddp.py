"""A hand-written minimal DDP loop: the baseline that scripts/bench_speed.py holds hydra_ddp to.

    torchrun --standalone --nproc_per_node=2 scripts/minimal_ddp.py --epochs 40

Same work as `hydra_ddp.train model=mlp data=digits` (the default job): the MLP of model=mlp
(hidden 256, depth 2, GELU, dropout 0.1), the digits train split of hydra_ddp.data.Digits,
64 samples per rank per step, AdamW(lr 2e-3, weight decay 0.01), gloo. A plain torch
DataLoader over a TensorDataset with a DistributedSampler; no scheduler, clipping, logging,
evaluation or checkpoint. Rank 0 prints `MINIMAL_DDP_SKIP` when step --skip is done and, at
the end, one JSON line: wall-clock times (time.time()) of the first step, of every 10th step
with the samples trained so far, and of the loop's start and end.
"""

import argparse
import json
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
train = order[round(len(x) * 0.15) + round(len(x) * 0.15):]
dataset = TensorDataset(torch.from_numpy(x[train]), torch.from_numpy(y[train]))
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

torch.manual_seed(0)
layers, width = [], 64  # hydra_ddp.models.MLP with hidden 256, depth 2, dropout 0.1
for _ in range(2):
    layers += [nn.Linear(width, 256), nn.GELU(), nn.Dropout(0.1)]
    width = 256
model = DDP(nn.Sequential(*layers, nn.Linear(width, 10)))
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
loss_fn = nn.CrossEntropyLoss()

step, samples, marks = 0, 0, {"every10": []}
t_loop = time.time()
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        loss = loss_fn(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
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
    print("MINIMAL_DDP " + json.dumps({**marks, "loop_start": t_loop, "loop_end": t_end,
                                       "steps": step, "samples_per_rank": samples,
                                       "world_size": world}), flush=True)
dist.barrier()  # without it gloo often aborts at exit (terminate called ...) on torch 2.13
dist.destroy_process_group()
