#!/usr/bin/env python3
"""Plots `scale.py` runs: how GetPage and memory follow a tenant's size, one line per run.

Input: the JSON files `scale.py --out` wrote (or the results/ files holding their `rows`), each
with a label (`LABEL=FILE`: e.g. the machine). Output: a PNG with three panels against the
size ingested: GetPage requests/s (8 x 1, no page cache), its p99, and the daemon's RSS after
a restart and after the reads (and after reads with the default page cache where the run has
it), with issue 22's targets drawn where they are absolute (RSS <= 256 MiB with the default
page cache); and on stdout each run's 20 GB (largest size) rate and p99 against its 1 GB
(smallest size) point, the ratios the targets are stated in (>= 0.8x, <= 1.5x).

Usage: plot_scale.py LABEL=RESULTS.json [LABEL=RESULTS.json ...] --plot OUT.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MIB = 1 << 20


def rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return sorted(data["rows"] if isinstance(data, dict) else data, key=lambda r: r["ingested_bytes"])


def labelled(ap: argparse.ArgumentParser, specs: list[str]) -> list[tuple[str, Path]]:
    """The `LABEL=FILE` arguments as (label, path); a malformed one is a usage error."""
    out = []
    for spec in specs:
        label, _, file = spec.partition("=")
        if not file:
            ap.error(f"{spec}: want LABEL=FILE")
        out.append((label, Path(file)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", metavar="LABEL=FILE")
    ap.add_argument("--plot", type=Path, required=True)
    ap.add_argument("--title", default="GetPage and memory against the tenant's size")
    args = ap.parse_args()
    runs = [(label, rows(file)) for label, file in labelled(ap, args.runs)]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, p99, rss) = plt.subplots(1, 3, figsize=(15, 5))
    top = 256.0
    for i, (label, rs) in enumerate(runs):
        color = f"C{i}"
        gb = [r["ingested_bytes"] / 1e9 for r in rs]
        rate.plot(gb, [r["get_page_rps"] for r in rs], "o-", color=color, label=label)
        p99.plot(gb, [(r["latency_us"] or {}).get("p99", 0) / 1000 for r in rs], "o-", color=color, label=label)
        rss.plot(gb, [r["rss_restarted_bytes"] / MIB for r in rs], "o:", color=color, label=f"{label}: after a restart")
        rss.plot(gb, [r["rss_after_reads_bytes"] / MIB for r in rs], "o-", color=color, label=f"{label}: after the reads")
        cached = [(g, r["rss_after_reads_default_page_cache_bytes"] / MIB)
                  for g, r in zip(gb, rs) if "rss_after_reads_default_page_cache_bytes" in r]
        if cached:
            rss.plot(*zip(*cached), "s--", color=color, label=f"{label}: after the reads, default page cache")
        top = max([top, *(r["rss_after_reads_bytes"] / MIB for r in rs), *(v for _, v in cached)])
        if len(rs) < 2:
            continue
        first, last = rs[0], rs[-1]
        lat = lambda r: (r["latency_us"] or {}).get("p99") or 0  # noqa: E731
        print(f"{label}: {last['ingested_bytes'] / 1e9:.1f} GB against {first['ingested_bytes'] / 1e9:.1f} GB: "
              f"rate {last['get_page_rps'] / max(first['get_page_rps'], 1):.2f}x, "
              f"p99 {lat(last) / max(lat(first), 1):.2f}x")
    rss.axhline(256, color="gray", linestyle="-.", linewidth=1, label="target with the default page cache")
    for ax, title, unit in [(rate, "GetPage, 8 x 1, no page cache", "requests/s"),
                            (p99, "GetPage p99", "ms"), (rss, "daemon RSS", "MiB")]:
        ax.set_title(title)
        ax.set_xlabel("GB ingested")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    p99.set_yscale("log")
    p99.set_ylim(0.05, None)
    rss.set_ylim(0, top * 1.7)  # room for the legend above the lines
    rate.legend(fontsize=8)
    rss.legend(fontsize=7, loc="upper left")
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
