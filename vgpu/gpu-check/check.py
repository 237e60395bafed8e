"""gpu-check: what gpupool-vgpu does on a real GPU, in one run (run.sh starts this).

Every check is one JSON line in <out>/results.jsonl: {"step", "check", "ok", ...figures}; "ok" is
true, false, or null (skipped, or a figure to read rather than a verdict). <out>/summary.txt sums
them up. Each workload runs as its own process with the library preloaded (LD_PRELOAD) and its
own limits, in a container of its own (a fresh CUDA_DEVICE_MEMORY_SHARED_CACHE), unless said.

Steps (README.md says what each checks and why):
  a  each allocation path to the limit and beyond; cuMemGetInfo, cuDeviceTotalMem, NVML v1/v2,
     cudaMemGetInfo (PyTorch, CuPy); managed memory keeping the contexts counted
  b  PyTorch's three allocators hitting the limit
  c  compute shares: pairs of containers 30/70, 10/90, 50/50 on the card's arbiter, and one alone
     under FORCE at 25, each with eager matmuls, CUDA graph replays, a Triton kernel and
     cooperative launches; NVIDIA MPS at 30/70 without the library, for reference
  d  the library's cost on launch-bound loops (driver API and PyTorch), without limits, in A B B A
  e  whether NVML's per-process queries answer here (asked while a kernel runs); what
     cuGetProcAddress returns
  f  the real nvidia-smi in a limited container: with HAMi-core's variables only, and with the
     driver's
"""

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
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
        self.sm_warmup, self.sm_seconds = args.sm_warmup, args.sm_seconds
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
            if name.startswith(("CUDA_DEVICE_", "GPU_CORE_", "PYTORCH_CUDA_ALLOC_CONF", "GPUPOOL_DEVICE_", "GPUPOOL_VGPU_", "CUDA_MPS_")):
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
            stdin=subprocess.PIPE,
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
    allocated = {}
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
        allocated[path] = fill["chunks"] * fill["chunk"] + (fill["exact_bytes"] if fill["exact"] == 0 else 0)
    if "cuMemAlloc" in allocated and "cuMemAllocManaged" in allocated:
        # The context stays counted with managed memory held: no more of it fits than of plain
        # memory (on the H200 the whole limit fit, the context's 543 MB out of the account).
        plain, managed = allocated["cuMemAlloc"], allocated["cuMemAllocManaged"]
        run.record("a", "managed memory keeps the contexts counted", managed <= plain + VIEW_SLACK,
                   plain_allocated=plain, managed_allocated=managed, context=run.limit - plain)
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


# ---- c: compute shares ------------------------------------------------------------------------

PY_MODES = ("eager", "graph", "triton")
C_MODE = "cooperative"


def read_until_ready(child, deadline):
    """What a workload prints up to its ready line (or its end, or the deadline). Read from the
    pipe itself: a buffered readline can take the ready line into its buffer with the line
    before it, and select would then wait for output that already came."""
    fd, data = child.stdout.fileno(), b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
        done, _, _ = data.rpartition(b"\n")
        if any(x.get("op") in ("ready", "skipped") for x in parse(done.decode(errors="replace"))):
            break
    # A partial last line (none expected: each line is written whole) waits for the rest.
    done, _, rest = data.rpartition(b"\n")
    child.pending = rest
    return parse(done.decode(errors="replace"))


class Tenant:
    """A container in a phase of step c: its limits (None: no library) and extra environment."""

    def __init__(self, name, limits=None, extra=None):
        self.name, self.limits, self.extra = name, limits, extra or {}


def phase(run, tenants, py_args, c_args, monitor=False):
    """Starts every tenant's PyTorch workload (slots 0-2) and driver-API workload (slot 3) in its
    own container, waits until all are ready, gives them one start time, and returns
    {tenant name: {mode: spin or share line}}, plus the NVML monitor's line."""
    warmup, seconds = run.sm_warmup, run.sm_seconds
    procs = []
    for t in tenants:
        container = run.container()
        Path(container).parent.mkdir(parents=True, exist_ok=True)
        env = {"preload": t.limits is not None, "limits": t.limits, "container": container,
               "extra": t.extra}
        py = subprocess.Popen(run.python("spin", "--modes", ",".join(PY_MODES), "--warmup", str(warmup),
                                         "--seconds", str(seconds), *py_args),
                              env=run.env(**env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(Path(container).parent / "py.stderr", "w"))
        c = subprocess.Popen([run.driver_check, "share", "--mode", C_MODE, "--slot", str(len(PY_MODES)),
                              "--warmup-ms", str(int(warmup * 1000)), "--seconds", str(seconds), *c_args],
                             env=run.env(**env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=open(Path(container).parent / "c.stderr", "w"))
        procs.append((t, py, c))
    got = {t.name: {} for t in tenants}
    extras = {t.name: [] for t in tenants}
    deadline = time.monotonic() + 90
    for t, py, c in procs:
        for child in (py, c):
            extras[t.name] += read_until_ready(child, deadline)
    start = time.monotonic() + 0.5
    total = (len(PY_MODES) + 1) * (warmup + seconds)
    mon = None
    if monitor:
        mon = run.start(run.python("monitor", "--seconds", str(total)), preload=False)
    for _, py, c in procs:
        for child in (py, c):
            try:
                child.stdin.write(f"{start}\n".encode())
                child.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
    for t, py, c in procs:
        for child in (py, c):
            try:
                out, _ = child.communicate(timeout=total + 120)
            except subprocess.TimeoutExpired:
                child.kill()
                out, _ = child.communicate()
            for line in extras[t.name] + parse((child.pending + out).decode(errors="replace")):
                if line.get("op") == "spin":
                    got[t.name][line["mode"]] = line
                elif line.get("op") == "share":
                    got[t.name][C_MODE] = line
                elif line.get("op") in ("triton", "skipped", "mode_skipped"):
                    got[t.name][line["op"]] = line
            extras[t.name] = []
    monitored = None
    if mon is not None:
        out, _ = mon.communicate(timeout=120)
        monitored = (ops(parse(out), "monitor") or [None])[0]
    return got, monitored


def mps_daemon(run):
    """NVIDIA MPS for the reference pair: a control daemon of our own (compute mode untouched),
    its pipe and log folders under the output folder. Returns (env for clients, stop) or None."""
    control = shutil.which("nvidia-cuda-mps-control")
    if not control:
        return None
    # Short: the control pipe is a Unix socket in it (at most 107 bytes of path).
    root = Path(tempfile.mkdtemp(prefix="gpuchk-mps-"))
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(root / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(root / "log"))
    (root / "pipe").mkdir()
    (root / "log").mkdir()
    if subprocess.run([control, "-d"], env=env, timeout=30).returncode != 0:
        return None

    def stop():
        subprocess.run([control], input="quit\n", env=env, text=True, timeout=30)
        shutil.copytree(root / "log", run.out / "mps-log", dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)

    return {k: env[k] for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}, stop


def step_c(run):
    # The card alone, without the library: what shares are shares of. It also sizes the fixed
    # work of the Triton and driver-API kernels (about 2 ms alone) for every later phase.
    got, _ = phase(run, [Tenant("alone")], ["--calibrate-ms", "2"], ["--calibrate-ms", "2"])
    alone = got["alone"]
    if "skipped" in alone and not any(m in alone for m in PY_MODES):
        run.record("c", "compute shares", None, skipped=f"{alone['skipped']['missing']} not installed")
    triton_iters = alone.get("triton", {}).get("iters", 0)
    c_iters = alone.get(C_MODE, {}).get("iters", 0)
    modes = [m for m in PY_MODES + (C_MODE,) if alone.get(m, {}).get("per_second")]
    run.record("c", "the card alone", None, alone={m: alone[m] for m in modes},
               triton_iters=triton_iters, cooperative_iters=c_iters)
    py_args = ["--triton-iters", str(triton_iters)]
    c_args = ["--iters", str(c_iters)]

    def share(line, mode):
        return line.get(mode, {}).get("per_second", 0.0) / alone[mode]["per_second"]

    # One card arbiter for the containers of each phase, as the driver mounts one per card.
    for pair in ((30, 70), (10, 90), (50, 50)):
        arbiter = str(run.out / f"arbiter-{pair[0]}-{pair[1]}")
        tenants = [Tenant(f"{limit}#{i}", {"CUDA_DEVICE_SM_LIMIT": str(limit)},
                          {"GPUPOOL_VGPU_ARBITER_0": arbiter}) for i, limit in enumerate(pair)]
        got, monitored = phase(run, tenants, py_args, c_args, monitor=pair == (30, 70))
        for mode in modes:
            shares = [share(got[t.name], mode) for t in tenants]
            ok = all(abs(s - limit / 100) <= 0.05 for s, limit in zip(shares, pair))
            run.record("c", f"SM {pair[0]}/{pair[1]}, {mode}", ok, limits=list(pair), shares=shares,
                       lines={t.name: got[t.name].get(mode) for t in tenants},
                       **({"nvml_monitor": monitored} if monitored and mode == "eager" else {}))
    got, _ = phase(run, [Tenant("force25", {"CUDA_DEVICE_SM_LIMIT": "25",
                                            "GPU_CORE_UTILIZATION_POLICY": "FORCE"})], py_args, c_args)
    for mode in modes:
        s = share(got["force25"], mode)
        run.record("c", f"SM 25 FORCE alone, {mode}", abs(s - 0.25) <= 0.05, limits=[25], shares=[s],
                   line=got["force25"].get(mode))
    daemon = mps_daemon(run)
    if daemon is None:
        run.record("c", "MPS 30/70 (reference)", None, skipped="nvidia-cuda-mps-control not available")
        return
    mps_env, stop = daemon
    try:
        tenants = [Tenant(f"mps{p}", None, dict(mps_env, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(p)))
                   for p in (30, 70)]
        got, _ = phase(run, tenants, py_args, c_args)
    finally:
        stop()
    for mode in modes:
        shares = [share(got[t.name], mode) for t in tenants]
        run.record("c", f"MPS 30/70 (reference, no library), {mode}", None, limits=[30, 70], shares=shares)


# ---- d: overhead without limits -------------------------------------------------------------------

def abba(run, argv, op, field, repeats, limits=None):
    """Medians of `field` without (A) and with (B) the library, in A B B A order."""
    runs = {False: [], True: []}
    for _ in range(repeats):
        for preload in (False, True, True, False):
            lines, _, _ = run.run(argv, preload=preload, limits=limits if preload else None)
            if skipped(lines):
                return None
            found = ops(lines, op)
            if found and field in found[0]:
                runs[preload].append(found[0][field])
    if not runs[False] or not runs[True]:
        return {}
    bare, ours = statistics.median(runs[False]), statistics.median(runs[True])
    return {"without_ns": bare, "with_ns": ours, "ratio": ours / bare, "runs": runs}


def step_d(run, count, repeats):
    for name, argv, op, limits in (
        ("driver API launch loop, no limit", [run.driver_check, "launch", "--count", str(count)], "launch", None),
        ("PyTorch launch loop, no limit", run.python("launchloop", "--count", str(count)), "launchloop", None),
        ("PyTorch launch loop, SM limit 50 alone", run.python("launchloop", "--count", str(count)), "launchloop",
         {"CUDA_DEVICE_SM_LIMIT": "50"}),
    ):
        figures = abba(run, argv, op, "median_ns", repeats if limits is None else 2, limits)
        if figures is None:
            run.record("d", name, None, skipped="torch not installed")
        elif not figures:
            run.record("d", name, False, error="no figures")
        elif limits is None and op == "launchloop":
            # No limit, no cost: at most 1 % on PyTorch's launch-bound loop.
            run.record("d", name, figures["ratio"] <= 1.01, **figures)
        else:
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
        }
        # Figures: the limiter no longer reads them, but what NVML's per-process utilisation says
        # while our kernel runs is a fact worth keeping.
        sampled = {
            "utilisation_samples": util.get("result") == 0 and bool(util.get("samples")),
            "own_pid_sampled": any(s["pid"] == pid for s in util.get("samples", [])),
        }
        context = [line for line in library_lines(stderr) if "context memory" in line or "host PID" in line]
        run.record("e", "NVML per-process queries", all(answers.values()), answers=answers,
                   sampled=sampled, nvml=found, library=context)
    bare, _, _ = run.run([run.driver_check, "procaddr"], preload=False)
    rows = ops(bare, "procaddr")
    run.record("e", "cuGetProcAddress returns exported symbols", None,
               same_as_export={r["symbol"]: r["same_as_export"] for r in rows})


# ---- f: nvidia-smi -------------------------------------------------------------------------------

def smi(run, container, limits):
    """The real nvidia-smi's memory figures of device 0 (MiB), in a container with the library."""
    tool = shutil.which("nvidia-smi")
    child = run.start([tool, "--query-gpu=memory.total,memory.used,memory.free", "--format=csv,noheader,nounits"],
                      limits=limits, container=container)
    out, stderr = child.communicate(timeout=60)
    try:
        total, used, free = (int(x) for x in out.strip().splitlines()[0].split(","))
        return {"total": total, "used": used, "free": free}
    except (ValueError, IndexError):
        return {"error": out.strip()[:500], "stderr": stderr[-500:], "exit": child.returncode}


def step_f(run):
    if not shutil.which("nvidia-smi"):
        run.record("f", "nvidia-smi", None, skipped="nvidia-smi not found")
        return
    limit_mib = run.limit // MIB
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                          capture_output=True, text=True).stdout.strip()
    cases = (
        # Another device plugin wrote only HAMi-core's variables: NVML index i has limit i.
        ("HAMi-core's variables only", {"CUDA_DEVICE_MEMORY_LIMIT": f"{limit_mib}m"}),
        # What gpupool's driver writes.
        ("the driver's variables", {"CUDA_DEVICE_MEMORY_LIMIT_0": f"{limit_mib}m", "GPUPOOL_DEVICE_UUID_0": uuid,
                                    "CUDA_VISIBLE_DEVICES": uuid}),
    )
    for name, limits in cases:
        container = run.container()
        # First alone (nvidia-smi the container's first program: nothing recorded the card yet),
        # then beside a process of the container holding 1 GiB.
        first = smi(run, container, limits)
        holder = run.start(run.python("hold", "--mib", "1024"), limits=limits, container=container)
        ready = parse(holder.stdout.readline()) if holder.stdout else []
        beside = smi(run, container, limits)
        holder.kill()
        holder.communicate()
        checks = {
            "total_is_the_limit_first": first.get("total") == limit_mib,
            "total_is_the_limit_beside": beside.get("total") == limit_mib,
            "used_is_the_containers": 1024 <= beside.get("used", 0) <= limit_mib,
        }
        if any(x.get("op") == "skipped" for x in ready):
            checks.pop("used_is_the_containers")
            checks.pop("total_is_the_limit_beside")
        run.record("f", f"nvidia-smi, {name}", all(checks.values()), checks=checks, first=first, beside=beside)


# ---- summary ----------------------------------------------------------------------------------------

def summary(run, started):
    lines = [f"gpu-check, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
             f"{time.monotonic() - started:.0f} s, limit {run.limit // MIB} MiB"]
    for step in "abcdef":
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
            elif r["step"] == "c" and "shares" in r:
                got = " / ".join(f"{100 * s:.1f}" for s in r["shares"])
                want = " / ".join(str(x) for x in r["limits"])
                lines.append(f"   {r['check']}: {got} % of the card alone (limits {want})")
            elif r["step"] == "d" and "ratio" in r:
                lines.append(f"   {r['check']}: median {r['without_ns']:.0f} ns without, "
                             f"{r['with_ns']:.0f} ns with the library ({r['ratio']:.3f}x)")
            elif r["step"] == "e" and "answers" in r:
                lines.append(f"   {r['check']}: {r['answers']}, {r['sampled']}; library: {r['library']}")
            elif r["step"] == "f" and "first" in r:
                lines.append(f"   {r['check']}: first {r['first']}, beside a 1 GiB holder {r['beside']}")
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
    parser.add_argument("--steps", default="abcdef")
    parser.add_argument("--limit-mib", type=int, default=4096)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--sm-warmup", type=float, default=1.0, help="seconds of warm-up per window, step c")
    parser.add_argument("--sm-seconds", type=float, default=3.0, help="seconds counted per window, step c")
    parser.add_argument("--launches", type=int, default=20000, help="launches per run in step d")
    parser.add_argument("--repeats", type=int, default=4, help="A B B A repeats in step d")
    args = parser.parse_args()
    run = Run(args)
    started = time.monotonic()
    steps = set(args.steps.replace(",", ""))
    # What matters most runs first, should the run be cut short.
    if "c" in steps:
        step_c(run)
    if "f" in steps:
        step_f(run)
    if "a" in steps:
        step_a(run, args.chunk_mib)
    if "d" in steps:
        step_d(run, args.launches, args.repeats)
    if "e" in steps:
        step_e(run)
    if "b" in steps:
        step_b(run, args.chunk_mib)
    sys.exit(0 if summary(run, started) else 1)


if __name__ == "__main__":
    main()
