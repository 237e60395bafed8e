"""The framework workloads of gpu-check, each run as its own process (so that the library, the
limits and the allocator settings of its environment apply from the start). Prints JSON lines.

    python3 workloads.py views                      torch/CuPy/NVML views of device 0
    python3 workloads.py fill --chunk-mib N         PyTorch tensors until OutOfMemoryError
    python3 workloads.py spin --mode eager|graph --seconds T --warmup W
                                                    matmuls (or CUDA graph replays), counted
    python3 workloads.py launchloop --count N       a launch-bound loop of tiny kernels
    python3 workloads.py monitor --seconds T        NVML per-process utilisation samples

A missing module is reported as {"op": "skipped", "missing": "<module>"} and exit status 4.
"""

import argparse
import json
import os
import sys
import time


def emit(**fields):
    print(json.dumps(fields), flush=True)


def need(module):
    try:
        return __import__(module)
    except ImportError:
        emit(op="skipped", missing=module)
        sys.exit(4)


def nvml_views():
    """NVML's memory views of device 0 (by the UUID CUDA gives it), or None without pynvml."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    out = {}
    try:
        m = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out["v1"] = {"total": m.total, "free": m.free, "used": m.used}
    except pynvml.NVMLError as e:
        out["v1"] = {"error": str(e)}
    try:
        m = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        out["v2"] = {"total": m.total, "free": m.free, "used": m.used, "reserved": m.reserved}
    except (pynvml.NVMLError, AttributeError, TypeError) as e:
        out["v2"] = {"error": str(e)}
    return out


def views(_args):
    torch = need("torch")
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(0)  # cudaMemGetInfo
    props = torch.cuda.get_device_properties(0)
    result = {"cuda_mem_get_info": {"free": free, "total": total}, "total_memory": props.total_memory}
    try:
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        result["cupy_mem_get_info"] = {"free": free, "total": total}
    except ImportError:
        result["cupy_mem_get_info"] = None
    result["nvml"] = nvml_views()
    emit(op="views", **result)


def fill(args):
    torch = need("torch")
    chunk = args.chunk_mib << 20
    held = []
    error = None
    while True:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError as e:
            error = str(e).splitlines()[0]
            break
        if len(held) > 100000:
            break
    free, total = torch.cuda.mem_get_info(0)
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    # The program goes on: give half back and allocate again.
    del held[: len(held) // 2]
    torch.cuda.empty_cache()
    try:
        held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        recovered = True
    except torch.cuda.OutOfMemoryError:
        recovered = False
    emit(
        op="fill",
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        chunks=len(held),
        oom=error,
        allocated=allocated,
        reserved=reserved,
        mem_get_info={"free": free, "total": total},
        recovered=recovered,
        nvml=nvml_views(),
    )


def spin(args):
    torch = need("torch")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    out = torch.empty(n, n, device="cuda", dtype=torch.float16)
    per_step = 1

    def step():
        torch.matmul(a, b, out=out)

    if args.mode == "graph":
        per_step = 8
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per_step):
                step()
        step = graph.replay
    torch.cuda.synchronize()
    measure_from = time.monotonic() + args.warmup
    end = measure_from + args.seconds
    steps, counted = 0, 0
    while time.monotonic() < end:
        step()
        steps += 1
        if steps % 4 == 0:
            # A few steps in flight, as a training loop has, never an unbounded queue.
            torch.cuda.current_stream().synchronize()
        if time.monotonic() >= measure_from:
            counted += per_step
    torch.cuda.synchronize()
    emit(op="spin", mode=args.mode, pid=os.getpid(), matmuls=counted, seconds=args.seconds,
         per_second=counted / args.seconds)


def launchloop(args):
    torch = need("torch")
    x = torch.zeros(1, device="cuda")
    for _ in range(1000):
        x.add_(1)
    torch.cuda.synchronize()
    times = []
    for i in range(args.count):
        t = time.perf_counter_ns()
        x.add_(1)
        times.append(time.perf_counter_ns() - t)
        if i % 1000 == 999:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times.sort()
    emit(op="launchloop", count=args.count, median_ns=times[len(times) // 2],
         p99_ns=times[len(times) * 99 // 100])


def monitor(args):
    pynvml = need("pynvml")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    last_seen = int(time.time() * 1e6)
    per_pid = {}
    end = time.monotonic() + args.seconds
    error = None
    while time.monotonic() < end:
        time.sleep(0.5)
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, last_seen)
        except pynvml.NVMLError as e:
            error = str(e)
            continue
        for s in samples:
            per_pid.setdefault(str(s.pid), []).append(s.smUtil)
            last_seen = max(last_seen, s.timeStamp)
    emit(op="monitor", error=error,
         mean_sm_util={pid: sum(v) / len(v) for pid, v in per_pid.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("views")
    p = sub.add_parser("fill")
    p.add_argument("--chunk-mib", type=int, default=64)
    p = sub.add_parser("spin")
    p.add_argument("--mode", choices=["eager", "graph"], default="eager")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p = sub.add_parser("launchloop")
    p.add_argument("--count", type=int, default=20000)
    p = sub.add_parser("monitor")
    p.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    {"views": views, "fill": fill, "spin": spin, "launchloop": launchloop, "monitor": monitor}[args.command](args)


if __name__ == "__main__":
    main()
