#!/usr/bin/env bash
# gpu-check: what gpupool-vgpu does on a real GPU, in one run of about six minutes (README.md).
#
#   vgpu/gpu-check/run.sh /path/to/libgpupool_vgpu.so [--out DIR] [--steps abcdef] [--limit-mib N]
#
# Needs: one NVIDIA GPU and its driver, python3, a C compiler (cc, gcc or nvcc); PyTorch, Triton, CuPy,
# nvidia-ml-py, nvidia-smi, nvidia-cuda-mps-control for the steps that use them (a missing one is
# reported as skipped). No network.
# Results: DIR/results.jsonl (one JSON line per check), DIR/summary.txt, DIR/environment.txt.
# Exit status: 0 when no check failed, 1 when one did, 2 on a usage error, 124 past 10 minutes.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
fi
library=$(realpath "$1")
shift
if [[ ! -f $library ]]; then
    echo "gpu-check: no library at $library" >&2
    exit 2
fi
out="gpu-check-$(date -u +%Y%m%dT%H%M%SZ)"
args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
mkdir -p "$out"
out=$(realpath "$out")

# What ran where: the card, the driver, the software.
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm)"
    echo "library: $library ($(sha256sum "$library" | cut -d' ' -f1))"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader \
        2>/dev/null || echo "nvidia-smi: not available"
    python3 - <<'EOF' 2>/dev/null || true
import importlib
for name in ("torch", "cupy", "pynvml"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', '?')}")
    except ImportError:
        print(f"{name}: not installed")
EOF
} > "$out/environment.txt"
cat "$out/environment.txt"

# The driver API checks need no CUDA header: any C compiler builds them.
compiler=$(command -v cc || command -v gcc || command -v nvcc || true)
if [[ -z $compiler ]]; then
    echo "gpu-check: no C compiler (cc, gcc or nvcc)" >&2
    exit 2
fi
"$compiler" -O2 -o "$out/driver_check" "$here/driver_check.c" -ldl

# The whole run stays under 10 minutes; each workload has its own timeout inside check.py.
exec timeout 590 python3 "$here/check.py" --library "$library" --driver-check "$out/driver_check" \
    --out "$out" "${args[@]}"
