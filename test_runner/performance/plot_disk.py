#!/usr/bin/env python3
"""Plots the disk of `scale.py` update loads over time, one line per run.

Input: JSON files `scale.py --update-seconds S --out` wrote (or results/ files holding their
`rows`), each with a label (`LABEL=FILE`: e.g. the build). Output: a PNG of each run's disk
(sampled every 5 s during the load and while the compactor catches up) over the disk right
after the operator's pass before the load (about the live data and the GC window when the
window is short), with issue 22's bound of 2x drawn; and on stdout each run's end, maximum and
median of the second half of the load, and what compaction wrote over what the load ingested.

Usage: plot_disk.py LABEL=RESULTS.json [LABEL=RESULTS.json ...] --plot OUT.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from plot_scale import labelled


def updates(path: Path) -> list[tuple[float, dict]]:
    """(size in GB, update result) of each row of `path` that ran the update load."""
    data = json.loads(path.read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    return [(r["size_gb"], r["update"]) for r in rows if r.get("update") and r["update"].get("disk_samples")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", metavar="LABEL=FILE")
    ap.add_argument("--plot", type=Path, required=True)
    ap.add_argument("--title", default="Disk under the update load, over the disk after the operator's pass")
    args = ap.parse_args()
    runs = [(f"{label} ({gb:g} GB)", u) for label, file in labelled(ap, args.runs) for gb, u in updates(file)]
    if not runs:
        ap.error("no update load with disk samples in these files")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for i, (label, u) in enumerate(runs):
        base = max(u["disk_after_operator_pass_bytes"], 1)
        t = [s for s, _ in u["disk_samples"]]
        ax.plot(t, [b / base for _, b in u["disk_samples"]], "-", color=f"C{i}", label=label)
        ax.axvline(u["seconds"], color=f"C{i}", linestyle=":", linewidth=0.8)
        print(f"{label}: disk at the end {u['disk_over_compacted']}x, max {u['disk_max_over_compacted']}x, "
              f"median of the second half {u['disk_median_second_half_over_compacted']}x; passes "
              f"{u['passes']} (GC {u.get('gc_passes', 0)}, full {u['full_passes']}); compaction wrote "
              f"{u['write_amplification']}x what the load ingested")
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=1, label="target: 2x")
    ax.set_xlabel("seconds since the update load began (dotted: its end)")
    ax.set_ylabel("disk / disk after the operator's pass")
    ax.set_ylim(bottom=0.9)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
