#!/usr/bin/env bash
# One machine, every GPU: torchrun --standalone with one process (DDP rank) per GPU.
#
#   scripts/launch_single_node.sh [key=value ...]          # N = number of visible GPUs
#   scripts/launch_single_node.sh -n 4 [key=value ...]     # N = 4 (e.g. CPU ranks)
#   NPROC=4 scripts/launch_single_node.sh [key=value ...]  # same
#
# Overrides go to hydra_ddp.train unchanged, e.g. `model=cnn trainer.batch_size=128`.
# Outputs land in outputs/<date>/<time>/ (one dir for the job, one train_rank<r>.log per rank).
# Set PYTHON to pick the interpreter (default: python). DRY_RUN=1 prints the command only.
set -euo pipefail

PYTHON=${PYTHON:-python}
nproc=${NPROC:-}
if [[ "${1:-}" == "-n" || "${1:-}" == "--nproc" ]]; then
    nproc=${2:?"$1 needs a number"}
    shift 2
fi
if [[ -z "$nproc" ]]; then
    # Honours CUDA_VISIBLE_DEVICES; 0 on a machine without CUDA.
    nproc=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    if [[ "$nproc" -lt 1 ]]; then
        echo "launch_single_node.sh: no GPU visible: running 1 process (use -n N for N CPU ranks)" >&2
        nproc=1
    fi
fi
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch_single_node.sh: the number of processes must be a positive integer, got '$nproc'" >&2
    exit 2
fi

# torchrun itself, whose stop on SIGTERM / Ctrl-C exits 143 / 130 without a traceback (plain
# torchrun: status 1 and torch's SignalException traceback, after the same checkpoint).
cmd=("$PYTHON" -m hydra_ddp.distributed.torchrun --standalone --nproc_per_node="$nproc"
     -m hydra_ddp.train "$@")
if [[ -n "${DRY_RUN:-}" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
