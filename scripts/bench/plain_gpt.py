"""A plain training loop of the example GPT, the yardstick for the template's GPU speed.

    torchrun --standalone --nproc_per_node=1 scripts/bench/plain_gpt.py --wrapper ddp
    torchrun --standalone --nproc_per_node=1 scripts/bench/plain_gpt.py --wrapper fsdp2

nanoGPT's hot path written out in plain torch: the model (hydra_ddp.models.GPT, the one
`model=gpt` builds), bf16 (autocast under DDP; FSDP2's MixedPrecisionPolicy with bf16
parameters and fp32 gradient reduction, as `ddp=fsdp2 ddp.param_dtype=bf16
ddp.reduce_dtype=fp32`), fused AdamW, the gradient norm clipped to 1.0, random tokens already
on the device (no data loading). Under FSDP2 each block is a unit and the root takes the rest,
as the template shards it. Prints one JSON line: tokens/s over the steps after --skip.
Apparatus (scripts/bench/gpu_check.sh runs it beside the template): plain torch, no config.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hydra_ddp.models import GPT

p = argparse.ArgumentParser()
p.add_argument("--wrapper", choices=["ddp", "fsdp2"], default="ddp")
p.add_argument("--n-layer", type=int, default=12)
p.add_argument("--n-embd", type=int, default=768)
p.add_argument("--n-head", type=int, default=12)
p.add_argument("--block-size", type=int, default=1024)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--vocab", type=int, default=96)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--skip", type=int, default=10)
args = p.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = (
    torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
)
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)
model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd, 0.0).to(device)
autocast = torch.autocast(device.type, dtype=torch.bfloat16)
if args.wrapper == "ddp":
    model = DDP(model)
else:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Under autocast the blocks need not cast their inputs (the template's choice too).
    in_blocks = MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mp_policy=in_blocks)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
x = torch.randint(args.vocab, (args.batch_size, args.block_size + 1), device=device)
inputs, targets = x[:, :-1], x[:, 1:]
start = None
for step in range(args.steps):
    if step == args.skip:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
    with autocast:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
if cuda:
    torch.cuda.synchronize()
elapsed = time.perf_counter() - start
tokens = (args.steps - args.skip) * args.batch_size * args.block_size * dist.get_world_size()
if rank == 0:
    print(json.dumps({"plain_loop": args.wrapper, "tokens_per_s": round(tokens / elapsed),
                      "ms_per_step": round(1000 * elapsed / (args.steps - args.skip), 2),
                      "loss": float(loss)}))  # fmt: skip
dist.destroy_process_group()
