"""gpu-check: what gpupool-vgpu does on a real GPU, in one run (run.sh starts this).

Every check is one JSON line in <out>/results.jsonl: {"step", "check", "ok", ...figures}; "ok" is
true, false, or null (skipped, or a figure to read rather than a verdict). <out>/summary.txt sums
them up. Each workload runs as its own process with the library preloaded (LD_PRELOAD) and its
own limits, in a container of its own (a fresh CUDA_DEVICE_MEMORY_SHARED_CACHE), unless said.

Steps (README.md says what each checks and why):
  a  each allocation path to the limit and beyond; cuMemGetInfo, cuDeviceTotalMem, NVML v1/v2,
     cudaMemGetInfo (PyTorch, CuPy)
  b  PyTorch's three allocators hitting the limit
  c  two containers capped 30 % and 70 %, eager and CUDA graph replay: throughput
  d  the library's cost without limits on launch-bound loops (driver API and PyTorch)
  e  whether NVML's per-process queries answer here; what cuGetProcAddress returns
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
# Two views taken a moment apart may differ by what the context grew meanwhile.
VIEW_SLACK = 4 * MIB


class Run:
    def __init__(self, args):
        self.library = args.library
        self.driver_check = args.driver_check
        self.out = Path(args.out)
        self.limit = args.limit_mib * MIB
        self.results = open(self.out / "results.jsonl", "a")
        self.rows = []
        self.containers = 0

    def record(self, step, check, ok, **figures):
        row = {"step": step, "check": check, "ok": ok, **figures}
        self.rows.append(row)
        self.results.write(json.dumps(row) + "\n")
        self.results.flush()
        mark = {True: "ok", False: "FAILED", None: "--"}[ok]
        print(f"[{step}] {check}: {mark}", flush=True)
        return row

    def container(self):
        self.containers += 1
        return str(self.out / "containers" / str(self.containers) / "vgpu.cache")

    def env(self, preload, limits, container=None, extra=None):
        env = dict(os.environ)
        for name in list(env):
            if name.startswith(("CUDA_DEVICE_", "GPU_CORE_", "PYTORCH_CUDA_ALLOC_CONF")):
                del env[name]
        env.pop("LD_PRELOAD", None)
        if preload:
            env["LD_PRELOAD"] = self.library
            env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = container or self.container()
        env.update(limits or {})
        env.update(extra or {})
        return env

    def start(self, argv, preload=True, limits=None, container=None, extra=None):
        return subprocess.Popen(
            argv,
            env=self.env(preload, limits, container, extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, argv, timeout=120, **kw):
        """Runs a workload to its end: (JSON lines, stderr, exit status); status None on timeout."""
        child = self.start(argv, **kw)
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, stderr = child.communicate()
            return parse(stdout), stderr, None
        return parse(stdout), stderr, child.returncode

    def python(self, *args):
        return [sys.executable, str(HERE / "workloads.py"), *args]


def parse(stdout):
    lines = []
    for line in stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return lines


def ops(lines, op):
    return [line for line in lines if line.get("op") == op]


def skipped(lines):
    """The module a workload could not import, if that is why it stopped."""
    missing = ops(lines, "skipped")
    return missing[0]["missing"] if missing else None


def library_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("gpupool-vgpu:")]


# ---- a: allocation paths ------------------------------------------------------------------------

PATHS = [
    ("cuMemAlloc", True), ("cuMemAllocManaged", True), ("cuMemAllocAsync", True),
    ("cuMemAllocFromPoolAsync", True), ("cuMemCreate", True), ("cuMemAllocPitch", False),
    ("cuArrayCreate", False), ("cuArray3DCreate", False), ("cuMipmappedArrayCreate", False),
]


def totals(view):
    """The totals every view of one line reports."""
    found = [view["cu_mem_get_info"]["total"], view["cu_device_total_mem"]["bytes"]]
    for form in ("nvml_v1", "nvml_v2"):
        if form in view:
            found.append(view[form]["total"])
    return found


def frees(view):
    found = [view["cu_mem_get_info"]["free"]]
    for form in ("nvml_v1", "nvml_v2"):
        if form in view:
            found.append(view[form]["free"])
    return found


def step_a(run, chunk_mib):
    limits = {"CUDA_DEVICE_MEMORY_LIMIT": str(run.limit)}
    chunk = chunk_mib * MIB
    for path, linear in PATHS:
        lines, stderr, code = run.run(
            [run.driver_check, "paths", "--path", path, "--chunk-mib", str(chunk_mib)], limits=limits
        )
        fills, views = ops(lines, "fill"), {v["when"]: v for v in ops(lines, "views")}
        if code != 0 or not fills or set(views) != {"before", "at_limit", "after"}:
            run.record("a", path, False, exit=code, lines=lines, stderr=library_lines(stderr))
            continue
        fill, at = fills[0], views["at_limit"]
        checks = {
            # The driver was never asked beyond the limit: CUDA_ERROR_OUT_OF_MEMORY from us.
            "refused_out_of_memory": fill["refused"] == 2,
            "every_total_is_the_limit": all(t == run.limit for t in totals(at)),
            "views_agree": max(frees(at)) - min(frees(at)) <= VIEW_SLACK,
            "less_than_a_chunk_left": at["cu_mem_get_info"]["free"] < chunk,
            "everything_freed": ops(lines, "freed")[0]["failed"] == 0,
            "memory_back_after_free": views["after"]["cu_mem_get_info"]["free"]
            >= views["before"]["cu_mem_get_info"]["free"] - VIEW_SLACK,
        }
        if linear:
            # Exactly what cuMemGetInfo said was left fits; one byte (granule) more does not.
            checks["exact_remainder_fits"] = fill["exact"] == 0
            checks["one_more_refused"] = fill["beyond"] == 2
        run.record("a", path, all(checks.values()), checks=checks, fill=fill, views=views)
    lines, stderr, code = run.run(run.python("views"), limits=limits)
    if skipped(lines):
        run.record("a", "runtime views", None, skipped=f"{skipped(lines)} not installed")
        return
    v = (ops(lines, "views") or [{}])[0]
    if not v:
        run.record("a", "runtime views", False, exit=code, stderr=stderr[-2000:])
        return
    found = [v["cuda_mem_get_info"]["total"], v["total_memory"]]
    free = [v["cuda_mem_get_info"]["free"]]
    if v.get("cupy_mem_get_info"):
        found.append(v["cupy_mem_get_info"]["total"])
        free.append(v["cupy_mem_get_info"]["free"])
    for form in ("v1", "v2"):
        if v.get("nvml") and "total" in v["nvml"].get(form, {}):
            found.append(v["nvml"][form]["total"])
            free.append(v["nvml"][form]["free"])
    ok = all(t == run.limit for t in found) and max(free) - min(free) <= VIEW_SLACK
    run.record("a", "runtime views", ok, views=v)


# ---- b: PyTorch's allocators --------------------------------------------------------------------

def step_b(run, chunk_mib):
    limits = {"CUDA_DEVICE_MEMORY_LIMIT": str(run.limit)}
    for conf in ("", "expandable_segments:True", "backend:cudaMallocAsync"):
        name = f"PyTorch allocator {conf or 'default'}"
        lines, stderr, code = run.run(
            run.python("fill", "--chunk-mib", str(chunk_mib)),
            limits=limits,
            extra={"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else None,
        )
        if skipped(lines):
            run.record("b", name, None, skipped=f"{skipped(lines)} not installed")
            continue
        fill = (ops(lines, "fill") or [None])[0]
        if fill is None:
            run.record("b", name, False, exit=code, stderr=stderr[-2000:])
            continue
        checks = {
            "out_of_memory_raised": fill["oom"] is not None,
            "reserved_within_limit": fill["reserved"] <= run.limit,
            "recovered_after_freeing": fill["recovered"],
            "mem_get_info_total_is_limit": fill["mem_get_info"]["total"] == run.limit,
        }
        run.record("b", name, all(checks.values()), checks=checks, fill=fill,
                   reserved_share=fill["reserved"] / run.limit)


# ---- c: SM limits 30 / 70 -------------------------------------------------------------------------

def spin_args(mode, seconds, warmup):
    return ["spin", "--mode", mode, "--seconds", str(seconds), "--warmup", str(warmup)]


def step_c(run, seconds):
    warmup = 3.0
    for mode in ("eager", "graph"):
        name = f"SM 30/70, {mode}"
        # The card's throughput alone, without the library: what the shares are shares of.
        lines, stderr, code = run.run(run.python(*spin_args(mode, seconds, warmup)), preload=False)
        if skipped(lines):
            run.record("c", name, None, skipped=f"{skipped(lines)} not installed")
            continue
        alone = (ops(lines, "spin") or [None])[0]
        if alone is None:
            run.record("c", name, False, exit=code, stderr=stderr[-2000:])
            continue
        # Two containers: policy DEFAULT throttles each while the other is on the card.
        children = {
            limit: run.start(run.python(*spin_args(mode, seconds, warmup)),
                             limits={"CUDA_DEVICE_SM_LIMIT": str(limit)})
            for limit in (30, 70)
        }
        time.sleep(warmup)
        monitor, _, _ = run.run(run.python("monitor", "--seconds", str(seconds)), preload=False,
                                timeout=seconds + 60)
        got = {}
        for limit, child in children.items():
            try:
                stdout, stderr = child.communicate(timeout=seconds + warmup + 120)
            except subprocess.TimeoutExpired:
                child.kill()
                stdout, stderr = child.communicate()
            spun = ops(parse(stdout), "spin")
            got[limit] = spun[0] if spun else {"per_second": 0, "stderr": stderr[-2000:]}
        share = {limit: got[limit]["per_second"] / alone["per_second"] for limit in got}
        ratio = got[30]["per_second"] / got[70]["per_second"] if got[70]["per_second"] else None
        ok = abs(share[30] - 0.30) <= 0.05 and 0.60 <= share[70] <= 0.75
        run.record("c", name, ok, alone=alone["per_second"], thirty=got[30], seventy=got[70],
                   share_30=share[30], share_70=share[70], ratio_30_to_70=ratio,
                   nvml_monitor=(ops(monitor, "monitor") or [None])[0])


# ---- d: overhead without limits -------------------------------------------------------------------

def abba(run, argv, op, field, repeats):
    """Medians of `field` without (A) and with (B) the library, in A B B A order."""
    runs = {False: [], True: []}
    for _ in range(repeats):
        for preload in (False, True, True, False):
            lines, _, _ = run.run(argv, preload=preload)
            if skipped(lines):
                return None
            found = ops(lines, op)
            if found and field in found[0]:
                runs[preload].append(found[0][field])
    if not runs[False] or not runs[True]:
        return {}
    bare, ours = statistics.median(runs[False]), statistics.median(runs[True])
    return {"without_ns": bare, "with_ns": ours, "ratio": ours / bare, "runs": runs}


def step_d(run, count):
    for name, argv, op in (
        ("driver API launch loop", [run.driver_check, "launch", "--count", str(count)], "launch"),
        ("PyTorch launch loop", run.python("launchloop", "--count", str(count)), "launchloop"),
    ):
        figures = abba(run, argv, op, "median_ns", 2)
        if figures is None:
            run.record("d", name, None, skipped="torch not installed")
        elif not figures:
            run.record("d", name, False, error="no figures")
        else:
            # A figure, not a verdict: the median launch call with the library, against without.
            run.record("d", name, None, **figures)


# ---- e: NVML per-process queries; cuGetProcAddress ---------------------------------------------

def step_e(run):
    lines, stderr, code = run.run(
        [run.driver_check, "nvml"],
        limits={"CUDA_DEVICE_MEMORY_LIMIT": str(run.limit)},
        extra={"LIBCUDA_LOG_LEVEL": "2"},
    )
    found = (ops(lines, "nvml") or [None])[0]
    setup = (ops(lines, "setup") or [{}])[0]
    if found is None:
        run.record("e", "NVML per-process queries", False, exit=code, stderr=stderr[-2000:])
    else:
        pid = setup.get("pid")
        procs = found.get("processes", {})
        mine = [p for p in procs.get("list", []) if p["pid"] == pid]
        util = found.get("utilization", {})
        answers = {
            "own_pid_listed": bool(mine),
            "own_memory_known": bool(mine) and mine[0]["used"] != (1 << 64) - 1,
            "utilisation_samples": util.get("result") == 0 and bool(util.get("samples")),
            "own_pid_sampled": any(s["pid"] == pid for s in util.get("samples", [])),
        }
        context = [line for line in library_lines(stderr) if "context memory" in line or "host PID" in line]
        run.record("e", "NVML per-process queries", all(answers.values()), answers=answers,
                   nvml=found, library=context)
    bare, _, _ = run.run([run.driver_check, "procaddr"], preload=False)
    rows = ops(bare, "procaddr")
    run.record("e", "cuGetProcAddress returns exported symbols", None,
               same_as_export={r["symbol"]: r["same_as_export"] for r in rows})


# ---- summary ----------------------------------------------------------------------------------------

def summary(run, started):
    lines = [f"gpu-check, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
             f"{time.monotonic() - started:.0f} s, limit {run.limit // MIB} MiB"]
    for step in "abcde":
        rows = [r for r in run.rows if r["step"] == step]
        if not rows:
            continue
        failed = [r["check"] for r in rows if r["ok"] is False]
        passed = sum(r["ok"] is True for r in rows)
        lines.append(f"{step}: {passed} ok, {len(failed)} failed, {len(rows) - passed - len(failed)} "
                     f"figures or skipped" + (f"; failed: {', '.join(failed)}" if failed else ""))
        for r in rows:
            if "skipped" in r:
                lines.append(f"   {r['check']}: skipped ({r['skipped']})")
            elif r["step"] == "c" and "share_30" in r:
                lines.append(f"   {r['check']}: shares {r['share_30']:.2f} / {r['share_70']:.2f} of the "
                             f"card alone, throughput ratio {r['ratio_30_to_70'] or 0:.2f} (0.43 = 30:70)")
            elif r["step"] == "d" and "ratio" in r:
                lines.append(f"   {r['check']}: median {r['without_ns']:.0f} ns without, "
                             f"{r['with_ns']:.0f} ns with the library ({r['ratio']:.3f}x)")
            elif r["step"] == "e" and "answers" in r:
                lines.append(f"   {r['check']}: {r['answers']}; library: {r['library']}")
            elif r["step"] == "e" and "same_as_export" in r:
                lines.append(f"   {r['check']}: {r['same_as_export']}")
    text = "\n".join(lines) + "\n"
    (run.out / "summary.txt").write_text(text)
    print(text, end="")
    return not any(r["ok"] is False for r in run.rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", required=True, help="libgpupool_vgpu.so to preload")
    parser.add_argument("--driver-check", required=True, help="the compiled driver_check.c")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", default="abcde")
    parser.add_argument("--limit-mib", type=int, default=4096)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--sm-seconds", type=float, default=10.0)
    parser.add_argument("--launches", type=int, default=20000, help="launches per run in step d")
    args = parser.parse_args()
    run = Run(args)
    started = time.monotonic()
    steps = set(args.steps.replace(",", ""))
    if "a" in steps:
        step_a(run, args.chunk_mib)
    if "b" in steps:
        step_b(run, args.chunk_mib)
    if "c" in steps:
        step_c(run, args.sm_seconds)
    if "d" in steps:
        step_d(run, args.launches)
    if "e" in steps:
        step_e(run)
    sys.exit(0 if summary(run, started) else 1)


if __name__ == "__main__":
    main()
