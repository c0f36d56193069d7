#!/usr/bin/env bash
# The full check of the CUDA/NCCL paths (CI has no GPU; about 5 minutes on one H200; the
# short one, about 3, is gpu_check.sh). Results go to docs/gpu_check.md.
#   PYTHONPATH=src bash scripts/bench/gpu_check_full.sh <work dir>
# With one GPU, DDP runs as one torchrun rank (a real NCCL process group, device_ids from
# LOCAL_RANK; two NCCL ranks cannot share a GPU) and the over-subscription error is checked
# with two; with two or more GPUs visible, a two-rank NCCL job runs too. Every shipped metric
# is evaluated on the GPU (classification, regression, language model), with EMA, compile,
# bf16, fp16 and a resume; `sync_debug` runs the steps between log intervals under
# torch.cuda.set_sync_debug_mode("error").
set -u
W=${1:-/tmp/gpu_check}
mkdir -p "$W"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd):${PYTHONPATH:-}"  # sync_check.py
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
  grep -E "process group up|error:|done \||sync check" "$W/$name.log" | cut -c 1-400
}
run single      "$PY" "${T[@]}" hydra.run.dir="$W/single"
run ddp_nccl    "${R[@]}" --nproc_per_node=1 "${T[@]}" hydra.run.dir="$W/ddp_nccl"
run fp16_scaler "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.precision=fp16 hydra.run.dir="$W/fp16_scaler"
run bf16_hook   "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.precision=bf16 ddp=bf16_compress hydra.run.dir="$W/bf16_hook"
run powersgd    "${R[@]}" --nproc_per_node=1 "${T[@]}" ddp=powersgd ddp.powersgd_start_iter=2 trainer.max_steps=60 hydra.run.dir="$W/powersgd"
run sharded     "${R[@]}" --nproc_per_node=1 "${T[@]}" sampler=sharded trainer.epochs=5 hydra.run.dir="$W/sharded"
run gpt_bf16    "${R[@]}" --nproc_per_node=1 "${T[@]}" data=text model=gpt model.n_layer=6 model.n_embd=384 model.n_head=6 data.block_size=256 trainer.batch_size=64 trainer.max_steps=300 trainer.precision=bf16 trainer.log_interval=50 hydra.run.dir="$W/gpt_bf16"
run regression  "${R[@]}" --nproc_per_node=1 "${T[@]}" data=diabetes trainer.batch_size=32 hydra.run.dir="$W/regression"
run ema         "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.ema_decay=0.99 trainer.eval_interval=200 hydra.run.dir="$W/ema"
run compile     "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.compile=true trainer.max_steps=200 hydra.run.dir="$W/compile"
run sync_debug  "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.eval_interval=0 trainer.ckpt_interval=0 trainer.ema_decay=0.99 trainer.max_steps=200 +callbacks.sync._target_=sync_check.SyncDebug '+callbacks.sync.log_interval=${trainer.log_interval}' '+callbacks.sync.max_steps=${trainer.max_steps}' hydra.run.dir="$W/sync_debug"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  run two_ranks "${R[@]}" --nproc_per_node=2 "${T[@]}" trainer.ema_decay=0.99 trainer.eval_interval=200 ddp=powersgd trainer.ckpt_interval=100 hydra.run.dir="$W/two_ranks"
fi
run resume      "${R[@]}" --nproc_per_node=1 "${T[@]}" trainer.max_steps=900 trainer.ckpt_interval=100 trainer.resume="$W/ddp_nccl/checkpoints/$(ls "$W/ddp_nccl/checkpoints" | tail -1)" hydra.run.dir="$W/resume"
run too_many    "${R[@]}" --nproc_per_node=2 "${T[@]}" hydra.run.dir="$W/too_many"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && $PY -c "import ray" 2>/dev/null; then
  # hydra/launcher=ray (the ray extra): two 1-GPU jobs of one sweep run side by side, each on
  # its own GPU. Read from the jobs' processes while they run: the CUDA_VISIBLE_DEVICES Ray
  # gave each, and the GPU nvidia-smi sees each one compute on.
  echo "=== ray_two_jobs: a Ray sweep of two 1-GPU jobs"
  $PY - "$W" "$PY" <<'PY'
import json, subprocess, sys, time, pathlib
import psutil
w, py = pathlib.Path(sys.argv[1]), sys.argv[2]
sweep = w / "ray_two_jobs"
cmd = [py, "-m", "hydra_ddp.train", "-m", "hydra/launcher=ray", "hydra.launcher.num_gpus=2",
       "logger=none", "trainer.progress=false", "dist.nproc_per_node=1", "trainer.max_steps=3000",
       "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"]
log = open(w / "ray_two_jobs.log", "w")
proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
visible, on_gpu = {}, {}
while proc.poll() is None:
    jobs = {}
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if "HYDRA_DDP_RAY_JOB" in env:  # a job's own process (it trains: one rank)
            jobs[p.pid] = env["HYDRA_DDP_RAY_JOB"]
            visible[env["HYDRA_DDP_RAY_JOB"]] = env.get("CUDA_VISIBLE_DEVICES")
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    for line in apps.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip().isdigit() and int(pid) in jobs:
            on_gpu.setdefault(jobs[int(pid)], set()).add(uuid.strip())
    time.sleep(0.5)
report = json.loads((sweep / "sweep_report.json").read_text())
print("rc", proc.returncode, "statuses", [j["status"] for j in report])
print("CUDA_VISIBLE_DEVICES by job", visible, "GPUs computed on by job", on_gpu)
ok = (proc.returncode == 0 and sorted(visible) == ["0", "1"]
      and all(v and len(v.split(",")) == 1 for v in visible.values())
      and visible["0"] != visible["1"]
      and not (on_gpu.get("0", set()) & on_gpu.get("1", set())))
print("ray_two_jobs disjoint GPUs:", "OK" if ok else "FAILED")
PY
fi

# ---- ddp=fsdp2 on NCCL: bf16 parameters, fp32 gradient reduce, beside DDP on the same GPT ----
# (A block of its own.) Both on as many ranks as GPUs allow (2 at most): tokens/s,
# state_bytes_per_rank and each rank's CUDA peak memory are printed side by side below. Then
# the sharded run resumes on 1 rank (another world size) and is exported (a folder).
G=(data=text model=gpt model.n_layer=6 model.n_embd=384 model.n_head=6 data.block_size=256 trainer.batch_size=64 trainer.max_steps=300 trainer.log_interval=50 trainer.ckpt_interval=100)
NP=$(( $(nvidia-smi -L | wc -l) >= 2 ? 2 : 1 ))
run gpt_ddp_bf16 "${R[@]}" --nproc_per_node=$NP "${T[@]}" "${G[@]}" trainer.precision=bf16 hydra.run.dir="$W/gpt_ddp_bf16"
run gpt_fsdp2    "${R[@]}" --nproc_per_node=$NP "${T[@]}" "${G[@]}" ddp=fsdp2 ddp.param_dtype=bf16 ddp.reduce_dtype=fp32 trainer.async_ckpt=true hydra.run.dir="$W/gpt_fsdp2"
$PY - "$W" <<'PY'
import json, sys, pathlib
w = pathlib.Path(sys.argv[1])
for name in ("gpt_ddp_bf16", "gpt_fsdp2"):
    s = json.loads((w / name / "summary.json").read_text())
    peaks = []
    for r in range(s["world_size"]):
        rows = [json.loads(l) for l in (w / name / "stats" / f"rank{r}.jsonl").read_text().splitlines() if l.strip()]
        peaks.append(max((x.get("cuda_peak_mem_mb") or 0) for x in rows))
    print(name, "ranks", s["world_size"], "steps", s["steps"], "tokens_per_s", round(s.get("tokens_per_s", 0)),
          "state_MiB_per_rank", [round(b / 2**20, 1) for b in s["state_bytes_per_rank"]],
          "cuda_peak_MiB_per_rank", peaks, "val_loss", round(s["val_loss"], 4))
PY
run gpt_fsdp2_meta "${R[@]}" --nproc_per_node=$NP "${T[@]}" "${G[@]}" ddp=fsdp2 ddp.meta_init=true trainer.max_steps=100 hydra.run.dir="$W/gpt_fsdp2_meta"
run gpt_fsdp2_1rank "${R[@]}" --nproc_per_node=1 "${T[@]}" "${G[@]}" ddp=fsdp2 ddp.param_dtype=bf16 trainer.max_steps=400 hydra.run.dir="$W/gpt_fsdp2"
run gpt_fsdp2_export "$PY" -m hydra_ddp.export run="$W/gpt_fsdp2"
run gpt_fsdp2_eval "$PY" -m hydra_ddp.eval run="$W/gpt_fsdp2" ckpt="$W/gpt_fsdp2/export/step_00000400"
grep -h "resumed from\|export\]\|test step" "$W/gpt_fsdp2_1rank.log" "$W/gpt_fsdp2_export.log" "$W/gpt_fsdp2_eval.log" | cut -c 1-300
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
