#!/usr/bin/env python3
"""Plots gpupool-trace's JSON (--json): unallocated GPU % against arrived workload %, one line per
mode (the mean over the seeds of each mode, per whole percent of arrivals), one panel per trace.

    python3 e2e/src/bin/gpupool-trace/plot_trace.py runs.json docs/trace-unallocated.png
    python3 e2e/src/bin/gpupool-trace/plot_trace.py --table runs.json   # BENCHMARKS.md's table

Several JSON files (one per gpupool-trace process) may be given before the PNG; they are merged.
Needs matplotlib (pip install matplotlib). Not run by CI.
"""
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FGD_DEFAULT_AT_100 = 4.77  # the FGD paper's best policy on the default trace (ATC'23)


def curves(runs):
    """{trace: {mode: [(arrived %, mean unallocated %)]}}, binned per whole percent arrived."""
    bins = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for run in runs:
        for point in run["curve"]:
            bins[run["trace"]][run["mode"]][int(point["arrived_percent"])].append(
                point["unallocated_percent"]
            )
    out = {}
    for trace, modes in bins.items():
        out[trace] = {
            mode: sorted((a, sum(v) / len(v)) for a, v in by_arrived.items())
            for mode, by_arrived in modes.items()
        }
    return out


def load(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.extend(json.load(f))
    return runs


def table(runs):
    """Per trace and mode: mean (sd) over the seeds, as gpupool-trace prints it."""
    keys = sorted({(r["trace"], r["mode"]) for r in runs}, key=lambda k: (k[0] != "default", k))
    print("| trace | mode | nodes | seeds | unallocated % at 100 % | at 130 % | placed | refused | pods/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for trace, mode in keys:
        sel = [r for r in runs if r["trace"] == trace and r["mode"] == mode]
        at100 = [r["unallocated_at_100"] for r in sel]
        mean = sum(at100) / len(at100)
        sd = (sum((x - mean) ** 2 for x in at100) / (len(at100) - 1)) ** 0.5 if len(at100) > 1 else None
        avg = lambda k: sum(r[k] for r in sel) / len(sel)  # noqa: E731
        nodes = "/".join(str(n) for n in sorted({r["nodes"] for r in sel}))
        seeds = ",".join(str(r["seed"]) for r in sel)
        sd_text = f" (sd {sd:.2f})" if sd is not None else ""
        print(f"| {trace} | {mode} | {nodes} | {seeds} | {mean:.2f}{sd_text} | "
              f"{avg('unallocated_at_130'):.2f} | {avg('placed'):.0f} | {avg('refused'):.0f} | "
              f"{avg('pods_per_second'):.1f} |")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--table":
        table(load(sys.argv[2:]))
        return
    if len(sys.argv) < 3:
        sys.exit("usage: plot_trace.py RUNS.json... OUT.png | --table RUNS.json...")
    runs = load(sys.argv[1:-1])
    per_trace = curves(runs)
    traces = sorted(per_trace, key=lambda t: (t != "default", t))
    cols = min(2, len(traces))
    rows = (len(traces) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.8 * rows), squeeze=False)
    for ax in axes.flat[len(traces):]:
        ax.set_visible(False)
    for ax, trace in zip(axes.flat, traces):
        for mode, points in sorted(per_trace[trace].items()):
            seeds = len({r["seed"] for r in runs if r["trace"] == trace and r["mode"] == mode})
            ax.plot([a for a, _ in points], [u for _, u in points],
                    label=f"{mode} ({seeds} seed{'s' if seeds > 1 else ''})")
        if trace == "default":
            ax.axhline(FGD_DEFAULT_AT_100, color="grey", linestyle=":", label="FGD at 100 % (paper)")
        ax.axvline(100, color="lightgrey", linewidth=0.8)
        ax.set_xlim(50, 132)
        ax.set_ylim(0, 60)
        nodes = {r["nodes"] for r in runs if r["trace"] == trace}
        ax.set_title(f"openb {trace} ({'/'.join(map(str, sorted(nodes)))} nodes)")
        ax.set_xlabel("arrived GPU request (% of capacity)")
        ax.set_ylabel("unallocated GPU %")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("Alibaba cluster-trace-gpu-v2023 (openb) through the real kube-scheduler v1.36.2, gpupool-trace", fontsize=10)
    fig.tight_layout()
    fig.savefig(sys.argv[-1], dpi=110)


if __name__ == "__main__":
    main()
