#!/usr/bin/env bash
# One short check of the CUDA/NCCL paths on a single-GPU machine (CI has no GPU).
#   PYTHONPATH=src bash scripts/bench/gpu_check.sh <work dir>
# Two ranks cannot share one GPU under NCCL, so DDP runs here as one torchrun rank (a real NCCL
# process group, device_ids from LOCAL_RANK); the over-subscription error is checked with two.
set -u
W=${1:-/tmp/gpu_check}
mkdir -p "$W"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'nccl', torch.cuda.nccl.version())"
T=(-m hydra_ddp.train logger=none trainer.progress=false)
R=($PY -m torch.distributed.run --standalone)
run() {  # name, then the command
  local name=$1; shift
  echo "=== $name: $*"
  "$@" > "$W/$name.log" 2>&1
  echo "rc=$?"
  grep -E "process group up|error:|done \|" "$W/$name.log" | cut -c 1-400
}
run single      "$PY" "${T[@]}" hydra.run.dir="$W/single"
run ddp_nccl    "${R[@]}" --nproc_per_node=1 "${T[@]}" hydra.run.dir="$W/ddp_nccl"
run fp16_scaler "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.precision=fp16 hydra.run.dir="$W/fp16_scaler"
run bf16_hook   "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.precision=bf16 ddp=bf16_compress hydra.run.dir="$W/bf16_hook"
run powersgd    "${R[@]}" --nproc_per_node=1 "${T[@]}" ddp=powersgd ddp.powersgd_start_iter=2 trainer.max_steps=60 hydra.run.dir="$W/powersgd"
run sharded     "${R[@]}" --nproc_per_node=1 "${T[@]}" sampler=sharded trainer.epochs=5 hydra.run.dir="$W/sharded"
run gpt_bf16    "${R[@]}" --nproc_per_node=1 "${T[@]}" data=text model=gpt model.n_layer=6 model.n_embd=384 model.n_head=6 data.block_size=256 trainer.batch_size=64 trainer.max_steps=300 trainer.precision=bf16 trainer.log_interval=50 hydra.run.dir="$W/gpt_bf16"
run resume      "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.max_steps=900 trainer.ckpt_interval=100 trainer.resume="$W/ddp_nccl/checkpoints/$(ls "$W/ddp_nccl/checkpoints" | tail -1)" hydra.run.dir="$W/resume"
run too_many    "${R[@]}" --nproc_per_node=2 "${T[@]}" hydra.run.dir="$W/too_many"
$PY - "$W" <<'PY'
import json, sys, pathlib
w = pathlib.Path(sys.argv[1])
out = {p.parent.name: json.loads(p.read_text()) for p in sorted(w.glob("*/summary.json"))}
(w / "summaries.json").write_text(json.dumps(out, indent=1))
for k, v in out.items():
    print(k, {x: v.get(x) for x in ("world_size", "steps", "test_acc", "val_loss", "samples_per_s", "tokens_per_s", "wall_time_s")})
# The per-interval stats gather runs asynchronously on the NCCL group: every interval must
# still reach rank 0's aggregate file, with CUDA memory among each rank's stats.
for k in out:
    agg = (w / k / "stats" / "aggregate.jsonl").read_text().splitlines()
    own = [json.loads(l) for l in (w / k / "stats" / "rank0.jsonl").read_text().splitlines()]
    print(k, "intervals", len(own), "aggregated", len(agg), "cuda_peak_mem_mb", own[-1].get("cuda_peak_mem_mb"))
PY
