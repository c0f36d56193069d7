#!/usr/bin/env bash
# The short GPU check (about 3 minutes on one H200; the full one, about 5, is
# gpu_check_full.sh). Results go to docs/gpu_check.md.
#   PYTHONPATH=src bash scripts/bench/gpu_check.sh <work dir>
# One NCCL rank (torchrun), python3, logger=none. It runs:
# - speed: DDP and fsdp2 (bf16 parameters, fp32 reduce) on the example GPT at 12 x 768 (block
#   1024, batch 16) and 6 x 384 (block 256, batch 64), bf16, checkpoints only at the end, 40
#   steps, the rate taken from the second log interval (steps 21-40); fsdp2 with the root as its
#   only unit at 12 x 768; a plain loop of the same model (plain_gpt.py) beside each;
# - a profile of steps 42-44 of both 12 x 768 runs (after the speed interval): the top ops by
#   self CUDA time and, per step, the device synchronisations and device-to-host copies;
# - sync_debug under DDP and fsdp2: the steps between log intervals under
#   torch.cuda.set_sync_debug_mode("error") (sync_check.py), exit 0 and its "sync check" line;
# - the memory plan against each run's measured peak (summary.json), the default digits job
#   and ddp=powersgd included.
# Without CUDA it runs the same on the CPU (gloo) at tiny sizes, as a check of the script:
# BIG and SMALL ("layers width heads block batch") and STEPS override the sizes and steps;
# RUN_TIMEOUT the seconds a job may take (120 on a GPU).
set -u
W=${1:-/tmp/gpu_check}
mkdir -p "$W"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd):${PYTHONPATH:-}"  # sync_check.py
BENCH=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$CUDA" = 1 ]; then
  nvidia-smi -L
  BIG=${BIG:-"12 768 12 1024 16"} SMALL=${SMALL:-"6 384 6 256 64"} STEPS=${STEPS:-40}
else
  echo "no CUDA: the same runs on the CPU at tiny sizes (a check of the script; CUDA-only parts skipped)"
  BIG=${BIG:-"2 64 2 32 4"} SMALL=${SMALL:-"2 32 2 16 4"} STEPS=${STEPS:-40}
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
LOG=$((STEPS / 2))
# Each job is stopped after RUN_TIMEOUT seconds (rc 124), so that a hang costs one job's time.
if [ "$CUDA" = 1 ]; then TO=${RUN_TIMEOUT:-120}; else TO=${RUN_TIMEOUT:-600}; fi
R=(timeout "$TO" $PY -m torch.distributed.run --standalone --nproc_per_node=1)
T=(-m hydra_ddp.train logger=none trainer.progress=false trainer.limit_eval_batches=1)
F=(ddp=fsdp2 ddp.param_dtype=bf16 ddp.reduce_dtype=fp32)
gpt() {  # layers width heads block batch
  echo data=text model=gpt model.n_layer=$1 model.n_embd=$2 model.n_head=$3 data.block_size=$4 \
    trainer.batch_size=$5 trainer.precision=bf16 trainer.max_steps=$STEPS trainer.log_interval=$LOG
}
plain() {  # name, wrapper, then the sizes
  local name=$1 wrapper=$2 t0=$SECONDS
  set -- $3
  echo "=== $name: plain_gpt.py --wrapper $wrapper $*"
  "${R[@]}" "$BENCH/plain_gpt.py" --wrapper "$wrapper" --n-layer "$1" --n-embd "$2" --n-head "$3" \
    --block-size "$4" --batch-size "$5" --steps "$STEPS" --skip "$LOG" > "$W/$name.log" 2>&1
  echo "$? $((SECONDS - t0))" > "$W/$name.rc"
  tail -1 "$W/$name.log" > "$W/$name.json"
}
run() {  # name, then the overrides
  local name=$1 t0=$SECONDS
  shift
  echo "=== $name: $*"
  "${R[@]}" "${T[@]}" "$@" hydra.run.dir="$W/$name" > "$W/$name.log" 2>&1
  echo "$? $((SECONDS - t0))" > "$W/$name.rc"
  grep -E "error:|sync check" "$W/$name.log" | cut -c 1-300
}
PROFILE=(trainer.max_steps=$((STEPS + 4)) trainer.profile_start=$((STEPS + 1)) trainer.profile_steps=3)
SYNC=(data=text model=gpt model.n_layer=2 model.n_embd=128 model.n_head=4 data.block_size=64
  trainer.batch_size=8 trainer.max_steps=$STEPS trainer.log_interval=10 trainer.eval_interval=0
  trainer.ckpt_interval=0 trainer.ema_decay=0.99 trainer.precision=bf16
  +callbacks.sync._target_=sync_check.SyncDebug '+callbacks.sync.log_interval=${trainer.log_interval}'
  '+callbacks.sync.max_steps=${trainer.max_steps}')

# The most telling runs first: a check cut short by its time still answers the main questions.
run big_ddp         $(gpt $BIG) "${PROFILE[@]}"
run big_fsdp2       $(gpt $BIG) "${F[@]}" "${PROFILE[@]}"
run small_ddp       $(gpt $SMALL)
run small_fsdp2     $(gpt $SMALL) "${F[@]}"
run sync_ddp        "${SYNC[@]}"
run sync_fsdp2      "${SYNC[@]}" "${F[@]}"
run digits          trainer.max_steps=$STEPS
run digits_powersgd ddp=powersgd ddp.powersgd_start_iter=2 trainer.max_steps=$STEPS
run big_fsdp2_root  $(gpt $BIG) "${F[@]}" 'ddp.shard_units=[]'
plain plain_big_ddp     ddp   "$BIG"
plain plain_big_fsdp2   fsdp2 "$BIG"
plain plain_small_ddp   ddp   "$SMALL"
plain plain_small_fsdp2 fsdp2 "$SMALL"

$PY - "$W" "$LOG" "$SECONDS" <<'PY'
import collections, json, pathlib, re, sys

w, log_interval, total = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
MiB = 2**20
runs, failed, summaries = {}, [], {}
for rc_file in sorted(w.glob("*.rc")):
    name = rc_file.stem
    rc, wall = map(int, rc_file.read_text().split())
    runs[name] = {"rc": rc, "wall_s": wall}
    if rc:
        failed.append(name)

def speed(name):
    """tokens/s of the second log interval (template), or the plain loop's (after --skip)."""
    if name.startswith("plain_"):
        text = (w / f"{name}.json").read_text().strip() if (w / f"{name}.json").exists() else ""
        return json.loads(text)["tokens_per_s"] if text.startswith("{") else None
    stats = w / name / "stats" / "rank0.jsonl"
    if not stats.exists():
        return None
    rows = [json.loads(row) for row in stats.read_text().splitlines() if row.strip()]
    second = [r for r in rows if r.get("step") == 2 * log_interval]
    return round(second[0]["tokens_per_s"]) if second and second[0].get("tokens_per_s") else None

print("\n=== runs (rc, wall s, tokens/s of steps", log_interval + 1, "-", 2 * log_interval, ")")
for name, r in runs.items():
    r["tokens_per_s"] = speed(name)
    print(f"{name:18} rc={r['rc']} wall={r['wall_s']:4d}s tokens/s={r['tokens_per_s']}")

print("\n=== speed ratios")
def ratio(a, b):
    x, y = runs.get(a, {}).get("tokens_per_s"), runs.get(b, {}).get("tokens_per_s")
    return f"{x / y:.2f}" if x and y else "n/a"
for size in ("big", "small"):
    print(f"{size}: fsdp2/ddp template {ratio(f'{size}_fsdp2', f'{size}_ddp')}, "
          f"plain {ratio(f'plain_{size}_fsdp2', f'plain_{size}_ddp')}; template/plain ddp "
          f"{ratio(f'{size}_ddp', f'plain_{size}_ddp')}, fsdp2 "
          f"{ratio(f'{size}_fsdp2', f'plain_{size}_fsdp2')}")
print(f"big: fsdp2 root only/ddp {ratio('big_fsdp2_root', 'big_ddp')}, "
      f"root only/per-block units {ratio('big_fsdp2_root', 'big_fsdp2')}")

print("\n=== memory: measured peak / plan (summary.json; on a CPU, tiny models: a few MiB of noise)")
outside = []
for s_path in sorted(w.glob("*/summary.json")):
    name = s_path.parent.name
    s = json.loads(s_path.read_text())
    summaries[name] = s
    plan, peaks = s.get("memory_plan"), [p for p in s.get("memory_peak_per_rank") or [] if p]
    if not plan or not peaks:
        print(f"{name:18} no plan or no measured peak")
        continue
    over = max(peaks) / plan["peak"]
    if not 0.75 <= over <= 1.25:
        outside.append(name)
    terms = {k: round(plan[k] / MiB, 1) for k in ("params", "grads", "optimizer", "buckets",
             "gathered", "hook_state", "workspaces", "activations") if plan.get(k)}  # fmt: skip
    print(f"{name:18} {s['memory_peak_measure']}: measured {max(peaks) / MiB:8.1f} MiB, plan "
          f"{plan['peak'] / MiB:8.1f} MiB, measured/plan {over:.2f}  {terms}")
(w / "summaries.json").write_text(json.dumps(summaries, indent=1))

print("\n=== profiles (steps with ProfilerStep in the trace)")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
for name in ("big_ddp", "big_fsdp2"):
    trace = w / name / "profile" / "rank0.pt.trace.json"
    if not trace.exists():
        print(name, "no trace")
        continue
    events = json.loads(trace.read_text())["traceEvents"]
    steps = len({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep")}) or 1
    calls = collections.Counter(e["name"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    dtoh = sum(1 for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", ""))
    kernels = collections.Counter()
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[e["name"][:80]] += e.get("dur", 0)
    print(f"{name}: {steps} steps; per step: syncs "
          f"{ {k: round(calls[k] / steps, 2) for k in SYNCS} } (the profiler's own stop syncs once), "
          f"device-to-host copies {dtoh / steps:.2f}, GPU busy {sum(kernels.values()) / 1000 / steps:.1f} ms")
    text = (w / f"{name}.log").read_text()
    table = re.search(r"profile of steps.*?\n(.*?Self CPU time total[^\n]*)", text, re.S)
    if table:
        print("\n".join(line[:160] for line in table.group(1).splitlines()[:16]))

print("\n=== sync_debug")
for name in ("sync_ddp", "sync_fsdp2"):
    text = (w / f"{name}.log").read_text() if (w / f"{name}.log").exists() else ""
    line = [ln for ln in text.splitlines() if "sync check:" in ln]
    print(f"{name}: rc={runs.get(name, {}).get('rc')} {line[-1].strip() if line else 'no sync check line'}")

print(f"\ngpu_check: {len(runs)} runs, failed: {failed or 'none'}; memory outside 25 %: "
      f"{outside or 'none'}; {total} s in all")
PY
