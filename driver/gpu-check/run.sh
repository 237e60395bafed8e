#!/usr/bin/env bash
# mps gpu-check: the driver's MPS shares (compute: Mps) on a real GPU, in one run of about a
# minute (README.md).
#
#   driver/gpu-check/run.sh /path/to/gpupool-mps-check [--out DIR] [--seconds T] [--warmup W]
#                           [--mps-control PATH] [--fake-gpus SPEC --cpu-only]
#
# Needs: one NVIDIA GPU (Volta or newer) and its driver, nvidia-cuda-mps-control, python3 with
# PyTorch, root (the daemon gets a mount namespace of its own). No network. Leaves the compute
# mode as it is. Results: DIR/results.jsonl, DIR/summary.txt, DIR/environment.txt.
# Exit status: 0 when no check failed, 1 when one did, 2 on a usage error, 124 past 2 minutes.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
fi
check=$(realpath "$1")
shift
if [[ ! -x $check ]]; then
    echo "mps gpu-check: no gpupool-mps-check at $check" >&2
    exit 2
fi
out="mps-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)"
control=nvidia-cuda-mps-control
args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --mps-control) control=$2; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
mkdir -p "$out"
out=$(realpath "$out")

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm)"
    echo "user: $(id)"
    echo "gpupool-mps-check: $check ($(sha256sum "$check" | cut -d' ' -f1))"
    echo "nvidia-cuda-mps-control: $(command -v "$control" || echo "$control: not found")"
    nvidia-smi --query-gpu=name,uuid,driver_version,compute_cap,compute_mode,mig.mode.current \
        --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
    python3 -c 'import torch; print("torch:", torch.__version__, torch.version.cuda)' 2>/dev/null \
        || echo "torch: not importable"
} > "$out/environment.txt"
cat "$out/environment.txt"

exec timeout 115 python3 "$here/check.py" --check "$check" --mps-control "$control" --out "$out" \
    "${args[@]}"
