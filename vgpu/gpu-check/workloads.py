"""The framework workloads of gpu-check, each run as its own process (so that the library, the
limits and the allocator settings of its environment apply from the start). Prints JSON lines.

    python3 workloads.py views                      torch/CuPy/NVML views of device 0
    python3 workloads.py fill --chunk-mib N         PyTorch tensors until OutOfMemoryError
    python3 workloads.py spin --modes eager,graph,triton --warmup W --seconds T [--slot K]
                              [--triton-iters N | --calibrate-ms M]
                                                    prepares every mode, prints {"op":"ready"},
                                                    reads a start time (CLOCK_MONOTONIC seconds)
                                                    on stdin, then runs mode i in slot K + i: a
                                                    warm-up of W s from start + slot x (W + T),
                                                    then T s counted: 8192^2 fp16 matmuls (eager),
                                                    replays of a CUDA graph of 8 (graph), or a
                                                    Triton kernel of fixed work (triton);
                                                    --mode M: one mode, started at once
    python3 workloads.py hold --mib N               holds N MiB (PyTorch) until stdin closes
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


def triton_busy(torch, calibrate_ms, iters):
    """A Triton kernel of fixed work over the whole card (a chain of multiply-adds per element),
    launched through Triton's own launcher. Returns (launch, iters, ms per launch measured), or
    None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def busy(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        for _ in range(n):
            x = x * 0.9999 + 0.0001
        tl.store(x_ptr + offs, x)

    block = 1024
    grid = (torch.cuda.get_device_properties(0).multi_processor_count * 8,)
    x = torch.ones(grid[0] * block, device="cuda", dtype=torch.float32)
    state = {"n": iters or 20000}

    def launch():
        busy[grid](x, state["n"], BLOCK=block)

    launch()  # compiles
    torch.cuda.synchronize()
    ms = 0.0
    for _ in range(5 if calibrate_ms else 1):
        t = time.monotonic()
        for _ in range(5):
            launch()
        torch.cuda.synchronize()
        ms = (time.monotonic() - t) * 1e3 / 5
        if calibrate_ms and ms > 0:
            state["n"] = max(1000, int(state["n"] * calibrate_ms / ms))
    return launch, state["n"], ms


def steps_until(torch, step, until):
    """Steps until `until` (monotonic seconds), a few in flight as a training loop has; how many."""
    done = 0
    while time.monotonic() < until:
        step()
        done += 1
        if done % 4 == 0:
            torch.cuda.current_stream().synchronize()
    return done


def spin(args):
    torch = need("torch")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    out = torch.empty(n, n, device="cuda", dtype=torch.float16)

    def matmul():
        torch.matmul(a, b, out=out)

    steps = {}  # mode -> (one step, units of work per step)
    requested = (args.mode or args.modes).split(",")
    for mode in requested:
        if mode == "eager":
            steps[mode] = (matmul, 1)
        elif mode == "graph":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    matmul()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(8):
                    matmul()
            steps[mode] = (graph.replay, 8)
        elif mode == "triton":
            found = triton_busy(torch, args.calibrate_ms, args.triton_iters)
            if found is None:
                emit(op="mode_skipped", mode=mode, missing="triton")
                continue
            launch, iters, ms = found
            steps[mode] = (launch, 1)
            emit(op="triton", iters=iters, launch_ms=ms)
        else:
            raise SystemExit(f"unknown mode {mode}")
    torch.cuda.synchronize()
    emit(op="ready", pid=os.getpid())
    # `--mode` (one mode) starts at once, without a start time on stdin.
    start = time.monotonic() if args.mode else float(sys.stdin.readline())
    for mode in steps:
        i = requested.index(mode)  # a skipped mode keeps its slot empty
        step, units = steps[mode]
        warm = start + (args.slot + i) * (args.warmup + args.seconds)
        measure_from, end = warm + args.warmup, warm + args.warmup + args.seconds
        time.sleep(max(0.0, warm - time.monotonic()))
        steps_until(torch, step, measure_from)
        # Counted from an empty queue to an empty queue: the work done in the window, whatever
        # the card's share.
        torch.cuda.synchronize()
        t0 = time.monotonic()
        done = steps_until(torch, step, end)
        torch.cuda.synchronize()
        elapsed = time.monotonic() - t0
        emit(op="spin", mode=mode, pid=os.getpid(), units=done * units, seconds=elapsed,
             per_second=done * units / elapsed)


def hold(args):
    torch = need("torch")
    held = torch.empty(args.mib << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    emit(op="ready", pid=os.getpid(), held=held.numel())
    sys.stdin.read()


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
    p.add_argument("--modes", default="eager,graph,triton")
    p.add_argument("--mode", help="one mode, started at once (no start time on stdin)")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--slot", type=int, default=0)
    p.add_argument("--triton-iters", type=int, default=0)
    p.add_argument("--calibrate-ms", type=float, default=0.0)
    p = sub.add_parser("hold")
    p.add_argument("--mib", type=int, default=1024)
    p = sub.add_parser("launchloop")
    p.add_argument("--count", type=int, default=20000)
    p = sub.add_parser("monitor")
    p.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    {"views": views, "fill": fill, "spin": spin, "hold": hold, "launchloop": launchloop,
     "monitor": monitor}[args.command](args)


if __name__ == "__main__":
    main()
