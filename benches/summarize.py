#!/usr/bin/env python3
"""Prints the markdown table of bench_walredo from criterion's estimates.

Reads <criterion dir>/<group>/<workload>/<N>/new/estimates.json (criterion writes the
benchmark id `async/short/64` as the directory `async/short/64` or `async/short_64`,
depending on its version), takes `median.point_estimate` (nanoseconds, per request), and
prints, per workload and N: the async and sync medians, async/sync, async/floor and sync/floor
(the floor exists at N = 1 only: `floor/echo/1`, `floor/echo-short/1`, `floor/echo-medium/1`),
and async throughput N / median relative to N = 1; then the two pinned floors
(`floor/echo-same-cpu/1`, `floor/echo-cross-cpu/1`); then, if the spin-window variants ran
(`spin/*`: sync with a 100 us window, `spin-async/*`), their medians next to `sync` and `async`;
then, if the adaptive variants ran (`adaptive-sync/*`, `adaptive-async/*`: the pool and spin
windows of the controller; `auto/*`: the same, and the controller's path), their medians
against the better of `sync` and `async` (one child), and `auto` against the best of the four
fixed-path variants and against the floor.

Usage: python3 benches/summarize.py [CRITERION_DIR]   (default: target/criterion, or
$CARGO_TARGET_DIR/criterion, looked up from the workspace root)
"""

import json
import os
import sys

WORKLOADS = ["ping", "short", "medium"]
CLIENTS = [1, 2, 4, 8, 16, 32, 64, 128]
SPIN_CLIENTS = [1, 2, 8]
ADAPTIVE_CLIENTS = [1, 2, 8, 64]
FLOOR = {"ping": "echo", "short": "echo-short", "medium": "echo-medium"}


def default_dir():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    return os.path.join(target, "criterion")


def median_ns(base, group, function, n):
    for name in (os.path.join(group, function, str(n)), os.path.join(group, f"{function}_{n}")):
        path = os.path.join(base, name, "new", "estimates.json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)["median"]["point_estimate"]
    return None


def us(ns):
    return "-" if ns is None else f"{ns / 1000:.1f}"


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def print_table(columns, rows):
    """A markdown table after a blank line, if there are rows; the first column is text, the others
    right-aligned."""
    if not rows:
        return
    print()
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))
    print("\n".join(rows))


def main():
    base = sys.argv[1] if len(sys.argv) > 1 else default_dir()
    if not os.path.isdir(base):
        sys.exit(f"no criterion results in {base}: run cargo bench -p benches --bench bench_walredo first")
    print("| workload | N | async median (us) | sync median (us) | async/sync | floor (us) "
          "| async/floor | sync/floor | async req/s | async thr. vs N=1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for workload in WORKLOADS:
        floor = median_ns(base, "floor", FLOOR[workload], 1)
        async_one = median_ns(base, "async", workload, 1)
        for n in CLIENTS:
            a = median_ns(base, "async", workload, n)
            s = median_ns(base, "sync", workload, n)
            f = floor if n == 1 else None
            throughput = None if a is None else n / (a / 1e9)
            scaling = "-" if a is None or async_one is None else f"{(n / a) / (1 / async_one):.2f}"
            print(f"| {workload} | {n} | {us(a)} | {us(s)} | {ratio(a, s)} | {us(f)} | {ratio(a, f)} "
                  f"| {ratio(s, f)} | {'-' if throughput is None else f'{throughput:,.0f}'} | {scaling} |")
    print()
    print("Pinned floors (ping): " + ", ".join(
        f"{name} {us(median_ns(base, 'floor', name, 1))} us" for name in ("echo-same-cpu", "echo-cross-cpu")))
    rows = []
    for workload in WORKLOADS:
        for n in SPIN_CLIENTS:
            sp, spa = median_ns(base, "spin", workload, n), median_ns(base, "spin-async", workload, n)
            if sp is None and spa is None:
                continue
            s, a = median_ns(base, "sync", workload, n), median_ns(base, "async", workload, n)
            f = median_ns(base, "floor", FLOOR[workload], 1) if n == 1 else None
            rows.append(f"| {workload} | {n} | {us(s)} | {us(sp)} | {ratio(sp, s)} | {us(a)} | {us(spa)} "
                        f"| {ratio(spa, a)} | {us(f)} | {ratio(sp, f)} |")
    print_table(["workload", "N", "sync (us)", "spin (us)", "spin/sync", "async (us)", "spin-async (us)",
                 "spin-async/async", "floor (us)", "spin/floor"], rows)
    rows = []
    for workload in WORKLOADS:
        for n in ADAPTIVE_CLIENTS:
            ad, ads = median_ns(base, "adaptive-async", workload, n), median_ns(base, "adaptive-sync", workload, n)
            au = median_ns(base, "auto", workload, n)
            if ad is None and ads is None and au is None:
                continue
            s, a = median_ns(base, "sync", workload, n), median_ns(base, "async", workload, n)
            best = min((x for x in (s, a) if x is not None), default=None)
            best4 = min((x for x in (s, a, ads, ad) if x is not None), default=None)
            f = median_ns(base, "floor", FLOOR[workload], 1) if n == 1 else None
            rows.append(f"| {workload} | {n} | {us(s)} | {us(a)} | {us(ads)} | {us(ad)} | {ratio(ads, best)} "
                        f"| {ratio(ad, best)} | {us(au)} | {ratio(au, best4)} | {us(f)} | {ratio(au, f)} |")
    print_table(["workload", "N", "sync (us)", "async (us)", "adaptive-sync (us)", "adaptive-async (us)",
                 "adaptive-sync/best", "adaptive-async/best", "auto (us)", "auto/best of 4", "floor (us)",
                 "auto/floor"], rows)


if __name__ == "__main__":
    main()
