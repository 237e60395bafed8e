"""mps gpu-check: the driver's MPS shares on a real GPU, in one run (run.sh starts this).

Every check is one JSON line in <out>/results.jsonl: {"step", "check", "ok", ...figures}; "ok" is
true, false, or null (a figure to read, or skipped). <out>/summary.txt sums them up; the exit
status is 1 when a check failed.

Steps (README.md says why):
  a  one client alone on the card without MPS: the throughput a share is measured against
  b  the driver prepares two claims, 30 and 70 cores of one card, with compute: Mps (its own
     ClaimPreparer: limits, node guard, the card's MPS daemon, CDI spec, checkpoint)
  c  two clients at once, each with what its claim's CDI spec gives a container (variables,
     the pipe folder and the daemon's /dev/shm mounted): their share of the alone throughput,
     and the daemon's server and client lists while they run
  d  a client of another user (uid 65534) through the same daemon (-M)
  e  the driver unprepares both (a later start of it, which adopts the daemon): the daemon, its
     servers and its folders are gone; the compute mode is what it was
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARES = (30, 70)
# What the H200 gave with nvidia-cuda-mps-control -d and these percentages by hand (0.30 and 0.66
# of one client alone, ENFORCEMENT.md facts): a share passes within these bounds.
BOUNDS = {30: (0.20, 0.40), 70: (0.55, 0.90)}
NOBODY = 65534


class Run:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.results = open(self.out / "results.jsonl", "a")
        self.rows = []
        # Short: the daemon's control socket path lies under it (at most 107 bytes).
        # On /run (a tmpfs, as a node's run folder is) where it can be: the daemon's /dev/shm is a
        # folder under it.
        base = "/run" if os.access("/run", os.W_OK) else None
        self.work = Path(tempfile.mkdtemp(prefix="gpupool-mps-", dir=base))
        # Traversable by every user, as a node's /var/run is: a client of another user reaches
        # the pipe folder under it.
        self.work.chmod(0o711)
        self.node = ["--dir", str(self.work), "--mps-control", args.mps_control]
        if args.fake_gpus:
            self.node += ["--fake-gpus", args.fake_gpus]

    def record(self, step, check, ok, **figures):
        row = {"step": step, "check": check, "ok": ok, **figures}
        self.rows.append(row)
        self.results.write(json.dumps(row) + "\n")
        self.results.flush()
        mark = {True: "ok", False: "FAILED", None: "--"}[ok]
        print(f"[{step}] {check}: {mark} {json.dumps(figures)[:300]}", flush=True)
        return row

    def check_tool(self, *argv, timeout=60):
        """gpupool-mps-check: its JSON lines, stderr and exit status (None on timeout)."""
        cmd = [self.args.check] + list(argv)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return [], str(e.stderr or ""), None
        lines = [json.loads(l) for l in done.stdout.splitlines() if l.startswith("{")]
        (self.out / "logs").mkdir(exist_ok=True)
        with open(self.out / "logs" / f"{argv[0]}.stderr", "a") as log:
            log.write(done.stderr)
        return lines, done.stderr, done.returncode

    def client_argv(self, seconds, warmup):
        if self.args.cpu_only:
            # The stand-in's CUDA client, held for the window: what attaches to the daemon here.
            return [self.args.mps_control, "--standin-cuda-client", "--hold-ms",
                    str(int((seconds + warmup) * 1000))]
        return [sys.executable, self.args.workloads, "spin", "--mode", "eager",
                "--seconds", str(seconds), "--warmup", str(warmup)]

    def start_client(self, spec, device, seconds, warmup, uid=None):
        argv = [self.args.check, "exec", "--spec", spec, "--device", device]
        if uid is not None:
            argv += ["--uid", str(uid)]
        env = dict(os.environ)
        # Only what the spec gives: no MPS variable of this shell leaks in.
        for name in list(env):
            if name.startswith("CUDA_MPS_") or name == "CUDA_VISIBLE_DEVICES":
                del env[name]
        return subprocess.Popen(argv + ["--"] + self.client_argv(seconds, warmup), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def last_json(text, op):
    found = None
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("op") == op:
                found = row
    return found


def wait(child, timeout):
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        return out, err, None
    return out, err, child.returncode


def compute_mode():
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def step_a(run):
    """One client alone, without MPS."""
    if run.args.cpu_only:
        return run.record("a", "alone_without_mps", None, skipped="no GPU workload on CPU")
    env = dict(os.environ)
    for name in list(env):
        if name.startswith("CUDA_MPS_"):
            del env[name]
    # A pipe folder with no daemon: whatever MPS this machine runs elsewhere, not this client.
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(run.work / "no-mps")
    child = subprocess.Popen(run.client_argv(run.args.seconds, run.args.warmup), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err, status = wait(child, run.args.seconds + run.args.warmup + 60)
    spin = last_json(out, "spin")
    if status != 0 or not spin:
        return run.record("a", "alone_without_mps", False, status=status, stderr=err[-2000:])
    return run.record("a", "alone_without_mps", True, per_second=spin["per_second"])


def step_b(run, multi_user):
    lines, err, status = run.check_tool(
        "prepare", *run.node, "--mps-multi-user", str(multi_user).lower(),
        "--cores", ",".join(str(s) for s in SHARES))
    prepared = {row["cores"]: row for row in lines if row.get("op") == "prepared" and "cores" in row}
    failed = [row for row in lines if row.get("op") == "prepared" and "error" in row]
    daemons = next((row["daemons"] for row in lines if row.get("op") == "daemons"), None)
    gpu = next((row for row in lines if row.get("op") == "gpu"), None)
    ok = status == 0 and len(prepared) == len(SHARES) and not failed
    run.record("b", f"prepare_30_70_multi_user_{str(multi_user).lower()}", ok, gpu=gpu,
               claims=[{k: r.get(k) for k in ("claim", "cdiDevice", "ready", "data", "spec")}
                       for r in prepared.values()],
               errors=[r["error"] for r in failed], daemons=daemons, status=status,
               stderr=err[-2000:] if not ok else "")
    if ok:
        for cores, row in prepared.items():
            spec = json.loads(Path(row["spec"]).read_text())
            device = next(d for d in spec["devices"] if row["cdiDevice"].endswith(d["name"]))
            env = device["containerEdits"]["env"]
            want = f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={cores}"
            run.record("b", f"spec_{cores}", want in env and
                       any(e.startswith("CUDA_MPS_PIPE_DIRECTORY=") for e in env), env=env,
                       mounts=[(m["hostPath"], m["containerPath"])
                               for m in device["containerEdits"].get("mounts", [])])
    return prepared if ok else None


def step_c(run, prepared, alone):
    seconds, warmup = run.args.seconds, run.args.warmup
    children = {c: run.start_client(r["spec"], r["cdiDevice"], seconds, warmup)
                for c, r in prepared.items()}
    # While both run: the daemon's servers and clients.
    time.sleep(warmup + min(2.0, seconds / 2))
    lines, err, status = run.check_tool("clients", *run.node)
    listed = [row for row in lines if row.get("op") == "clients"]
    servers = [s for row in listed for s in row.get("servers", [])]
    clients = sum(len(s.get("clients", [])) for s in servers)
    run.record("c", "one_server_two_clients_while_running", status == 0 and len(servers) == 1
               and clients == len(SHARES), servers=servers, status=status,
               log=[row.get("log") for row in listed])
    results = {}
    for cores, child in children.items():
        out, err, status = wait(child, seconds + warmup + 60)
        op = "client" if run.args.cpu_only else "spin"
        row = last_json(out, op)
        results[cores] = row
        if run.args.cpu_only:
            got = row.get("activeThreadPercentage") if row else None
            run.record("c", f"client_{cores}_through_mps", status == 0 and bool(row)
                       and row.get("mps") is True and got == float(cores), client=row,
                       stderr=err[-2000:] if status != 0 else "")
        elif status != 0 or not row:
            run.record("c", f"client_{cores}", False, status=status, stderr=err[-2000:])
    if run.args.cpu_only or alone is None or any(r is None for r in results.values()):
        return
    shares = {c: r["per_second"] / alone for c, r in results.items()}
    for cores, share in shares.items():
        low, high = BOUNDS[cores]
        run.record("c", f"share_{cores}", low <= share <= high, share=round(share, 3),
                   per_second=results[cores]["per_second"], alone=alone, bounds=[low, high])
    run.record("c", "thirty_below_seventy", shares[30] < shares[70],
               ratio=round(shares[30] / shares[70], 3) if shares[70] else None)


def step_d(run, prepared, multi_user):
    if not multi_user:
        return run.record("d", "client_of_another_user", None, skipped="the daemon runs without -M")
    row = prepared[SHARES[0]]
    seconds = 1 if not run.args.cpu_only else 0.2
    child = run.start_client(row["spec"], row["cdiDevice"], seconds, 0.5, uid=NOBODY)
    out, err, status = wait(child, 90)
    got = last_json(out, "client" if run.args.cpu_only else "spin")
    ok = status == 0 and bool(got) and (got.get("mps", True) is True)
    run.record("d", "client_of_another_user", ok, uid=NOBODY, result=got, status=status,
               stderr=err[-2000:] if not ok else "")


def step_e(run, mode_before):
    lines, err, status = run.check_tool("unprepare", *run.node)
    cleanup = next((row for row in lines if row.get("op") == "cleanup"), None)
    run.record("e", "unprepare_stops_the_daemon_and_leaves_nothing", status == 0 and bool(cleanup)
               and cleanup.get("ok") is True, cleanup=cleanup,
               unprepared=[row for row in lines if row.get("op") == "unprepared"],
               stderr=err[-2000:] if status != 0 else "")
    if not run.args.cpu_only:
        after = compute_mode()
        run.record("e", "compute_mode_unchanged", after == mode_before, before=mode_before,
                   after=after)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", required=True, help="the gpupool-mps-check binary")
    parser.add_argument("--mps-control", default="nvidia-cuda-mps-control")
    parser.add_argument("--workloads", default=str(HERE.parent.parent / "vgpu/gpu-check/workloads.py"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--fake-gpus", help="fake GPUs (CPU only, with the stand-in daemon)")
    parser.add_argument("--cpu-only", action="store_true",
                        help="no GPU workload: the stand-in's CUDA client attaches instead")
    args = parser.parse_args()
    run = Run(args)
    mode_before = None if args.cpu_only else compute_mode()
    run.record("a", "compute_mode_before", None, compute_mode=mode_before)
    alone = step_a(run).get("per_second")
    prepared, multi_user = step_b(run, True), True
    if prepared is None:
        # -M not taken by this nvidia-cuda-mps-control: clean up, measure without it.
        step_e(run, mode_before)
        prepared, multi_user = step_b(run, False), False
    if prepared is not None:
        step_c(run, prepared, alone)
        step_d(run, prepared, multi_user)
    step_e(run, mode_before)
    failed = [r for r in run.rows if r["ok"] is False]
    lines = [f"{r['step']} {r['check']}: {'FAILED' if r['ok'] is False else 'ok' if r['ok'] else '--'}"
             for r in run.rows]
    lines.append(f"{len(failed)} failed, {sum(1 for r in run.rows if r['ok'])} ok")
    (run.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    # The node's own folders of this run (state, CDI specs, run folder); the daemon's were the
    # driver's to remove, and step e checked that it did.
    shutil.rmtree(run.work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
