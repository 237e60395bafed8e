#!/usr/bin/env python3
"""Plots gpupool-trace's JSON (--json): unallocated GPU % against arrived workload %, one line per
mode (the mean over the seeds of each mode, per whole percent of arrivals), one panel per trace.

    python3 e2e/src/bin/gpupool-trace/plot_trace.py runs.json docs/trace-unallocated.png

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


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_trace.py RUNS.json OUT.png")
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    per_trace = curves(runs)
    traces = sorted(per_trace, key=lambda t: (t != "default", t))
    fig, axes = plt.subplots(1, len(traces), figsize=(5.5 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces):
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
    fig.suptitle("Alibaba cluster-trace-gpu-v2023 through kube-scheduler v1.36.2 (gpupool-trace)")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
