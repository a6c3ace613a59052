#!/usr/bin/env python3
"""Plots and tabulates a `measure.py` run of the page service writers against the loopback floor.

Input: the JSON that `measure.py --scenarios cached --kinds "floor,auto:page_service_io=epoll,
auto:page_service_io=io_uring,auto:page_service_io=auto" --points ...` wrote. Output: a PNG with
replies per second (top) and daemon CPU per reply (bottom) against connections, one column per
pipeline depth, one line per writer; and on stdout a Markdown table per depth with the ratios
docs/performance.md quotes (each writer against `epoll` and against the floor) and the send
syscalls per reply from the daemon's metrics. A daemon variant run from another build
(`...:bin=DIR`, e.g. a baseline commit's writer) is drawn as a line of its own, named after DIR
or as `--label DIR=NAME` says, and listed in a table of its own (rps and CPU per reply against
`epoll` of the same run).

Usage: plot_page_service_io.py RESULTS.json --plot OUT.png [--title TEXT] [--label DIR=NAME ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WRITERS = ["floor", "epoll", "io_uring", "auto"]
STYLE = {"floor": ("black", ":"), "epoll": ("tab:blue", "-"), "io_uring": ("tab:orange", "-"),
         "auto": ("tab:green", "--")}


def writer_of(kind: str, labels: dict[str, str]) -> str:
    """`floor`, or the `page_service_io` value of a daemon kind like `auto:page_service_io=epoll`,
    followed by ` (NAME)` for a variant from another build (`bin=DIR`)."""
    writer, build = kind, None
    for part in kind.split(":"):
        if part.startswith("page_service_io="):
            writer = part.split("=", 1)[1]
        elif part.startswith("bin="):
            build = part.split("=", 1)[1]
    if build is not None:
        writer += f" ({labels.get(build, Path(build).name)})"
    return writer


def load(path: Path, labels: dict[str, str]) -> dict[tuple[str, int, int], dict]:
    """(writer, depth, connections) -> the point's result (closed-loop points only)."""
    out = {}
    for r in json.loads(path.read_text()):
        if r.get("rate") or "summary" not in r:
            continue
        out[(writer_of(r["kind"], labels), r["depth"], r["connections"])] = r
    return out


def others(points: dict) -> list[str]:
    """The writers from other builds."""
    return sorted({w for (w, _, _) in points if w not in WRITERS})


def others_table(points: dict, depth: int) -> str:
    """rps and CPU per reply of the other builds' writers, against `epoll` of the same run."""
    rows = [f"**depth {depth}, other builds**", "",
            "| conns | writer | rps | / epoll | CPU us/reply | / epoll | send syscalls/reply |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for c in sorted({c for (_, d, c) in points if d == depth}):
        epoll = points.get(("epoll", depth, c))
        for w in others(points):
            r = points.get((w, depth, c))
            if not r:
                continue
            rps, cpu = r["summary"]["rps"], cpu_per_reply(r)
            e_rps = epoll["summary"]["rps"] if epoll else None
            e_cpu = cpu_per_reply(epoll) if epoll else None
            rows.append(f"| {c} | {w} | {rps:.0f} | {f'{rps / e_rps:.2f}' if e_rps else '-'} | {cpu} | "
                        f"{f'{cpu / e_cpu:.2f}' if cpu and e_cpu else '-'} | "
                        f"{r['per_request'].get('send_syscalls', '-')} |")
    return "\n".join(rows)


def cpu_per_reply(r: dict) -> float | None:
    return (r.get("cpu") or {}).get("cpu_us_per_request")


def table(points: dict, depth: int) -> str:
    conns = sorted({c for (_, d, c) in points if d == depth})
    rows = [f"**depth {depth}**", "",
            "| conns | floor rps | epoll rps | io_uring rps | auto rps | io_uring / epoll | auto / epoll "
            "| epoll / floor | best / floor | p99 us epoll / io_uring / auto | CPU us/reply floor / epoll / "
            "io_uring / auto | send syscalls/reply epoll / io_uring / auto | auto via ring |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|"]
    for c in conns:
        get = {w: points.get((w, depth, c)) for w in WRITERS}
        rps = {w: (r["summary"]["rps"] if r else None) for w, r in get.items()}

        def ratio(a, b):
            return f"{rps[a] / rps[b]:.2f}" if rps.get(a) and rps.get(b) else "-"

        best = max((rps[w] for w in ("epoll", "io_uring", "auto") if rps[w]), default=None)
        best_floor = f"{best / rps['floor']:.2f}" if best and rps["floor"] else "-"
        p99 = " / ".join(str(get[w]["summary"]["latency_us"]["p99"]) if get[w] else "-"
                         for w in ("epoll", "io_uring", "auto"))
        cpu = " / ".join(f"{cpu_per_reply(get[w])}" if get[w] else "-" for w in WRITERS)
        sys_ = " / ".join(f"{get[w]['per_request'].get('send_syscalls', '-')}" if get[w] else "-"
                          for w in ("epoll", "io_uring", "auto"))
        share = get["auto"]["per_request"].get("io_uring_share", "-") if get["auto"] else "-"
        cells = [str(c)] + [f"{rps[w]:.0f}" if rps[w] else "-" for w in WRITERS]
        cells += [ratio("io_uring", "epoll"), ratio("auto", "epoll"), ratio("epoll", "floor"), best_floor,
                  p99, cpu, sys_, str(share)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(points: dict, out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({d for (_, d, _) in points})
    fig, axes = plt.subplots(2, len(depths), figsize=(6 * len(depths), 8), squeeze=False)
    for col, depth in enumerate(depths):
        for w in WRITERS + others(points):
            series = sorted((c, r) for (ww, d, c), r in points.items() if ww == w and d == depth)
            if not series:
                continue
            xs = [c for c, _ in series]
            color, line = STYLE.get(w, ("tab:gray", "-."))
            axes[0][col].plot(xs, [r["summary"]["rps"] / 1000 for _, r in series], line, color=color,
                              marker="o", label=w)
            cpu = [(c, cpu_per_reply(r)) for c, r in series if cpu_per_reply(r)]
            axes[1][col].plot([c for c, _ in cpu], [v for _, v in cpu], line, color=color, marker="o", label=w)
        for row, ylabel in enumerate(["thousand replies / s", "daemon CPU us / reply"]):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("connections")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend()
        axes[0][col].set_title(f"cached GetPage, depth {depth}")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--plot", type=Path, required=True)
    parser.add_argument("--title", default="page service writers against the loopback floor")
    parser.add_argument("--label", action="append", default=[], metavar="DIR=NAME",
                        help="the name of the variant run from DIR (bin=DIR)")
    opts = parser.parse_args()
    labels = dict(label.split("=", 1) for label in opts.label)
    points = load(opts.results, labels)
    if not points:
        raise SystemExit(f"no closed-loop points in {opts.results}")
    for depth in sorted({d for (_, d, _) in points}):
        print(table(points, depth))
        print()
        if others(points):
            print(others_table(points, depth))
            print()
    plot(points, opts.plot, opts.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
