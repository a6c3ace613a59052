#!/usr/bin/env python3
"""Measures how the walredo configuration follows a 10x load step, and what it costs once idle.

Not a test (pytest collects only test_*.py): a script to reproduce a published table.

    cargo build --release --bins
    .venv/bin/pip install -r test_runner/performance/requirements.txt   # matplotlib, for the plot
    .venv/bin/python test_runner/performance/load_step.py --bin-dir target/release --out step.json --plot step.png

Method:

- One daemon per process kind of --kinds (measure.py's syntax: a kind, then settings after
  colons), all alive together, each holding the --scenario data set (measure.SCENARIOS, loaded
  with `pagebench ingest --tenant bench <shape>`).
- --rounds rounds; in each, every kind makes one run, in an order that rotates each round, so
  that a drift of the machine's speed hits every kind alike. Before each run the script waits
  for the machine to be quiet (--quiet-below, as in measure.py).
- A run is one open-loop pagebench schedule, then no load:

      pagebench get-page --tenant bench <shape> --lsn <scenario lsn> --connections C
          --rate LOW:Ls,HIGH:Hs,LOW:As --series <work dir>/series-rN.jsonl

  (C = --connections, LOW/HIGH = --low/--high requests/s, L/H/A = --low-seconds,
  --high-seconds, --after-seconds), then --idle-seconds without requests.
- While it runs and through the idle seconds, a thread samples every 0.1 s: the tenant status
  (`GET /v1/tenant/bench`, docs/http-api.md): the number of redo children
  (`walredo.pool.children`), how many spin (`spin_us` > 0), their paths, and the controller's
  `path` and `target_children` (null before its first period); and from /proc the CPU ticks of
  the daemon, of each of its redo children (measure.Daemon.redo_children), of pagebench and of
  the machine. The sampling itself costs the daemon 10 status requests per second, which the
  idle figure includes.
- Times are pagebench's clock: seconds since the start of its schedule (after its connections
  are open). The script places that start at the exit of pagebench minus the `duration_s` of its
  summary, which is also the moment of the last reply ("the end of the load"); the exit itself
  makes that a few ms late at most.

Figures per run (times in pagebench's clock; phases: low [0, L], high [L, L+H], after
[L+H, L+H+A], idle [end + 1 s, end of sampling], where `end` is the last reply):

- per second, from the --series lines (each covers the interval from the previous line's `t`,
  or 0, to its own `t`): rps, target rps, p99;
- `step_rps_first_second`: the rps of the first series line whose interval starts at or after L
  (10 ms tolerance) and lasts at least 0.99 s: with a whole L, the second [L, L+1], the first
  whole second at the high rate; `step_p99_us`: that second's p99; `step_fraction_of_target`:
  its rps over --high;
- `high_rps_mean`: requests over seconds of the series lines inside the high phase;
  `high_p99_us_max`: the largest p99 of those seconds;
- `high_children_max`, `high_spinning_max`: the most children and spinning children sampled in
  the high phase; `after_children`, `after_spinning`: the most sampled in the last second of
  the after phase; `idle_children`, `idle_spinning`: the last sample of the idle seconds;
- `cpu_pct`: the CPU of the daemon plus its redo children, in % of one vCPU, per phase (between
  the first and the last sample inside it; a child's ticks count from its first sample in the
  phase, or from 0 if it started within it); `idle` is the issue's target ("within 1 s after the
  last request, the daemon and its children together use < 1% of a vCPU"). /proc counts CPU in
  ticks of 1/CLK_TCK s (10 ms), so a phase's figure is a multiple of its `resolution`, one tick
  over the phase: 0.5% over the 2 s of idle window that the default --idle-seconds 3 leaves;
  --idle-seconds 11 gives 0.1%;
- `seconds_until_no_child_spins`: from the last reply to the first sample from which on no
  child spins to the end of sampling (0.0: none spun after the load; null: still spinning at
  the end); `seconds_until_one_child`: likewise until at most one child is left;
- `other_cpu_pct`: CPU (% of one vCPU) of other processes during the load (the machine's busy
  time less the daemon, its children and pagebench): a large figure makes the run suspect.

Output: per kind, the median over rounds of each figure, and `step_ratio_to_best_static`: the
median over rounds of the kind's `step_rps_first_second` over the best one among the kinds that
are not `auto` in the same round (the best static configuration; likewise `high_ratio_to_best_static`
for `high_rps_mean`), as a markdown table on stdout; everything (options, the pagebench
summaries, raw series and samples, per-run figures, medians) in the --out JSON, written after
every run. With --plot, a PNG of round 1: per kind, rps per second against the target, the
number of children and of spinning children, and CPU per 0.5 s.

Every daemon started is stopped (SIGTERM, then SIGKILL after 30 s) and its work dir removed
(unless --keep) before the script exits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the sibling script's daemon, pagebench and sampling helpers

TENANT = "bench"
SAMPLE_INTERVAL = 0.1  # seconds between samples
STATUS_TIMEOUT = 2.0  # seconds for one tenant status request
EDGE = 0.01  # seconds of tolerance where a series line meets a phase boundary


def number(x: float) -> str:
    """A number as pagebench's --rate takes it (no exponent)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def tenant_status(daemon: measure.Daemon) -> dict:
    url = f"http://{daemon.http}/v1/tenant/{TENANT}"
    try:
        with urllib.request.urlopen(url, timeout=STATUS_TIMEOUT) as resp:
            return json.loads(resp.read().decode())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RuntimeError(f"failed to read the tenant status {url}: {e}") from e


def pool_of(status: dict) -> dict:
    """The `walredo.pool` object of a tenant status, or a clear error."""
    pool = (status.get("walredo") or {}).get("pool")
    if not isinstance(pool, dict) or not isinstance(pool.get("children"), list):
        raise RuntimeError("the tenant status has no walredo.pool.children: is the pageserver of --bin-dir "
                           f"older than the redo pool? (status: {json.dumps(status)[:300]})")
    return pool


class PoolSampler(threading.Thread):
    """Samples the tenant's redo pool and the CPU of the daemon, its children and pagebench
    every SAMPLE_INTERVAL until stopped."""

    def __init__(self, daemon: measure.Daemon, bench_pid: int, t0: float):
        super().__init__(daemon=True)
        self.daemon_proc = daemon
        self.bench_pid = bench_pid
        self.t0 = t0
        self.samples: list[dict] = []
        self.failures = 0
        self.first_error: str | None = None
        self.stop_event = threading.Event()

    def sample(self) -> dict:
        kids = self.daemon_proc.redo_children()
        s = {
            "t": time.monotonic() - self.t0,
            "daemon_ticks": measure.read_cpu_ticks(self.daemon_proc.pid) or 0,
            "redo_ticks": {k: t for k in kids if (t := measure.read_cpu_ticks(k)) is not None},
            "bench_ticks": measure.read_cpu_ticks(self.bench_pid),
            "system": measure.read_system_cpu(),
        }
        try:
            pool = pool_of(tenant_status(self.daemon_proc))
        except RuntimeError as e:
            self.failures += 1
            if self.first_error is None:
                self.first_error = str(e)
                print(f"   status sample failed: {e}", file=sys.stderr)
            s["children"] = None  # a gap in the pool's figures; the CPU figures still count
            return s
        children = pool["children"]
        controller = pool.get("controller")
        s.update(children=len(children),
                 spinning=sum(1 for c in children if (c.get("spin_us") or 0) > 0),
                 paths=sorted(str(c.get("path")) for c in children),
                 controller_path=controller.get("path") if controller else None,
                 target_children=controller.get("target_children") if controller else None)
        return s

    def run(self) -> None:
        due = time.monotonic()
        while True:
            try:
                self.samples.append(self.sample())
            except Exception as e:  # noqa: BLE001 - a failed sample is a gap, not the end
                self.failures += 1
                if self.first_error is None:
                    self.first_error = f"{type(e).__name__}: {e}"
                    print(f"   sample failed: {self.first_error}", file=sys.stderr)
            due += SAMPLE_INTERVAL
            if self.stop_event.wait(max(due - time.monotonic(), 0.0)):
                return


def read_series(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def per_second(series: list[dict]) -> list[dict]:
    """The series lines with the start of their interval (the previous line's `t`, or 0)."""
    out, start = [], 0.0
    for line in series:
        out.append({"t_start": start, "t_end": line["t"], "requests": line["requests"], "rps": line["rps"],
                    "target_rps": line["target_rps"], "late": line["late"], "errors": line["errors"],
                    "p99_us": line["latency_us"]["p99"]})
        start = line["t"]
    return out


def within(samples: list[dict], a: float, b: float) -> list[dict]:
    return [s for s in samples if a <= s["t"] <= b]


def cpu_pct(samples: list[dict], a: float, b: float) -> dict | None:
    """CPU of the daemon and its redo children between the first and last sample in [a, b], in %
    of one vCPU. A child's ticks count from the first sample (0 if it started later) to the last
    sample in which it appears."""
    inside = within(samples, a, b)
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    seconds = last["t"] - first["t"]
    if seconds <= 0:
        return None
    last_seen: dict[int, int] = {}
    for s in inside:
        last_seen.update(s["redo_ticks"])
    redo = sum(ticks - first["redo_ticks"].get(pid, 0) for pid, ticks in last_seen.items())
    pct = lambda ticks: round(100.0 * ticks / measure.CLK_TCK / seconds, 2)  # noqa: E731
    daemon = last["daemon_ticks"] - first["daemon_ticks"]
    return {"seconds": round(seconds, 2), "daemon": pct(daemon), "redo": pct(redo), "total": pct(daemon + redo),
            "resolution": pct(1)}


def other_cpu_pct(samples: list[dict], a: float, b: float) -> float | None:
    """CPU (% of one vCPU) of processes other than the daemon, its children and pagebench."""
    inside = [s for s in within(samples, a, b) if s["bench_ticks"] is not None]
    ours = cpu_pct(inside, a, b)
    if ours is None:
        return None
    first, last = inside[0], inside[-1]
    d = {k: last["system"][k] - first["system"][k] for k in first["system"]}
    total = sum(d.values()) or 1
    busy = 100.0 * measure.os.cpu_count() * (total - d["idle"] - d["iowait"]) / total
    bench = 100.0 * (last["bench_ticks"] - first["bench_ticks"]) / measure.CLK_TCK / ours["seconds"]
    return round(busy - ours["total"] - bench, 1)


def seconds_until(samples: list[dict], end: float, bad) -> float | None:
    """Seconds from `end` to the first sample from which on no sample is `bad`; None if the last
    one still is."""
    after = [s for s in samples if s["t"] >= end and s["children"] is not None]
    if not after or bad(after[-1]):
        return None
    last_bad = max((i for i, s in enumerate(after) if bad(s)), default=None)
    if last_bad is None:
        return 0.0
    return round(after[last_bad + 1]["t"] - end, 2)


def figures(opts, seconds: list[dict], samples: list[dict], end: float) -> dict:
    low, high, after = opts.low_seconds, opts.low_seconds + opts.high_seconds, \
        opts.low_seconds + opts.high_seconds + opts.after_seconds
    step = next((p for p in seconds if p["t_start"] >= low - EDGE and p["t_end"] - p["t_start"] >= 0.99), None)
    in_high = [p for p in seconds if p["t_start"] >= low - EDGE and p["t_end"] <= high + EDGE]
    high_secs = sum(p["t_end"] - p["t_start"] for p in in_high)
    pool = [s for s in samples if s["children"] is not None]
    high_pool = within(pool, low, high)
    after_pool = within(pool, max(high, after - 1.0), after)
    idle_pool = [s for s in pool if s["t"] >= end]
    phase_cpu = {"low": cpu_pct(samples, 0.0, low), "high": cpu_pct(samples, low, high),
                 "after": cpu_pct(samples, high, after), "idle": cpu_pct(samples, end + 1.0, float("inf"))}
    return {
        "step_rps_first_second": step["rps"] if step else None,
        "step_second": [step["t_start"], step["t_end"]] if step else None,
        "step_fraction_of_target": round(step["rps"] / opts.high, 3) if step else None,
        "step_p99_us": step["p99_us"] if step else None,
        "high_rps_mean": round(sum(p["requests"] for p in in_high) / high_secs, 1) if high_secs else None,
        "high_p99_us_max": max((p["p99_us"] for p in in_high), default=None),
        "high_children_max": max((s["children"] for s in high_pool), default=None),
        "high_spinning_max": max((s["spinning"] for s in high_pool), default=None),
        "high_controller_paths": sorted({str(s["controller_path"]) for s in high_pool}),
        "after_children": max((s["children"] for s in after_pool), default=None),
        "after_spinning": max((s["spinning"] for s in after_pool), default=None),
        "idle_children": idle_pool[-1]["children"] if idle_pool else None,
        "idle_spinning": idle_pool[-1]["spinning"] if idle_pool else None,
        "cpu_pct": phase_cpu,
        "cpu_pct_low": (phase_cpu["low"] or {}).get("total"),
        "cpu_pct_high": (phase_cpu["high"] or {}).get("total"),
        "cpu_pct_after": (phase_cpu["after"] or {}).get("total"),
        "cpu_pct_idle": (phase_cpu["idle"] or {}).get("total"),
        "seconds_until_no_child_spins": seconds_until(samples, end, lambda s: s["spinning"] > 0),
        "seconds_until_one_child": seconds_until(samples, end, lambda s: s["children"] > 1),
        "other_cpu_pct": other_cpu_pct(samples, 0.0, end),
    }


def run_once(opts, scenario: dict, daemon: measure.Daemon, kind: str, round_no: int) -> dict:
    """One run: the step schedule, then --idle-seconds without load."""
    busy = measure.wait_for_quiet_machine(opts.quiet_below, opts.quiet_max_wait)
    pool_of(tenant_status(daemon))  # fail now, with a clear error, if the status is unreadable
    series_path = daemon.workdir / f"series-r{round_no}.jsonl"
    series_path.unlink(missing_ok=True)
    rate = (f"{number(opts.low)}:{number(opts.low_seconds)}s,{number(opts.high)}:{number(opts.high_seconds)}s,"
            f"{number(opts.low)}:{number(opts.after_seconds)}s")
    args = ["get-page", "--tenant", TENANT, *scenario["shape"], "--lsn", scenario["lsn"],
            "--connections", str(opts.connections), "--rate", rate, "--series", str(series_path)]
    schedule_s = opts.low_seconds + opts.high_seconds + opts.after_seconds
    t0 = time.monotonic()
    proc = measure.pagebench(opts.bin_dir, daemon, args)
    sampler = PoolSampler(daemon, proc.pid, t0)
    sampler.start()
    try:
        try:
            summary = measure.finish(proc, schedule_s + 120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        exited = time.monotonic()
        sampler.stop_event.wait(opts.idle_seconds)
    finally:
        sampler.stop_event.set()
        sampler.join(timeout=STATUS_TIMEOUT + 5)
    # pagebench's clock: its schedule started `duration_s` before its exit.
    offset = exited - summary["duration_s"] - t0
    samples = list(sampler.samples)
    for s in samples:
        s["t"] = round(s["t"] - offset, 3)
    if not any(s["children"] is not None for s in samples):
        raise RuntimeError(f"no tenant status could be read during the run of {kind}: {sampler.first_error}")
    series = read_series(series_path)
    if not series:
        raise RuntimeError(f"pagebench wrote no --series lines to {series_path}")
    seconds = per_second(series)
    return {
        "kind": kind,
        "round": round_no,
        "rate": rate,
        "machine_busy_before_pct": busy,
        "summary": summary,
        "end_s": summary["duration_s"],
        "status_failures": sampler.failures,
        "figures": figures(opts, seconds, samples, summary["duration_s"]),
        "per_second": seconds,
        "series": series,
        "samples": samples,
    }


def is_static(kind: str) -> bool:
    return kind.split(":")[0] != "auto"


def summarize(runs: list[dict], kinds: list[str], rounds: int) -> dict:
    """Per kind: the median over rounds of each figure, and the ratios to the best static kind."""
    out = {}
    numeric = [k for k, v in runs[0]["figures"].items() if not isinstance(v, (dict, list))]
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind]
        ratios: dict[str, list] = {"step_rps_first_second": [], "high_rps_mean": []}
        for r in range(rounds):
            this = next((x for x in mine if x["round"] == r), None)
            static = [x for x in runs if x["round"] == r and is_static(x["kind"])]
            for key in ratios:
                best = max((x["figures"][key] or 0 for x in static), default=0)
                value = this["figures"][key] if this else None
                ratios[key].append(round(value / best, 3) if best and value is not None else None)
        out[kind] = {
            "rounds": len(mine),
            "median": {k: measure.median_or_none([r["figures"][k] for r in mine]) for k in numeric},
            "step_ratio_to_best_static": {"median": measure.median_or_none(ratios["step_rps_first_second"]),
                                          "rounds": ratios["step_rps_first_second"]},
            "high_ratio_to_best_static": {"median": measure.median_or_none(ratios["high_rps_mean"]),
                                          "rounds": ratios["high_rps_mean"]},
        }
    return out


def print_table(results: dict) -> None:
    m = results["meta"]
    print(f"{m['scenario']}, {m['connections']} connections: {m['low']:g}/s for {m['low_seconds']:g} s, "
          f"{m['high']:g}/s for {m['high_seconds']:g} s, {m['low']:g}/s for {m['after_seconds']:g} s, idle "
          f"{m['idle_seconds']:g} s; median of {m['rounds']} rounds; CPU in % of one vCPU (daemon + redo "
          "children)\n")
    print("| kind | step rps (1st s) | / best static | high rps (mean) | p99 us (1st s) | children (high, max) "
          "| children / spinning (last s after) | children / spinning (end of idle) | CPU % low | CPU % high "
          "| CPU % after | CPU % idle (from 1 s after) | s until no child spins | other CPU % |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
    for kind, k in results["kinds"].items():
        md = k["median"]
        print(f"| {kind} | {fmt(md['step_rps_first_second'])} | {fmt(k['step_ratio_to_best_static']['median'])} "
              f"| {fmt(md['high_rps_mean'])} | {fmt(md['step_p99_us'])} | {fmt(md['high_children_max'])} "
              f"| {fmt(md['after_children'])} / {fmt(md['after_spinning'])} "
              f"| {fmt(md['idle_children'])} / {fmt(md['idle_spinning'])} | {fmt(md['cpu_pct_low'])} "
              f"| {fmt(md['cpu_pct_high'])} | {fmt(md['cpu_pct_after'])} | {fmt(md['cpu_pct_idle'])} "
              f"| {fmt(md['seconds_until_no_child_spins'])} | {fmt(md['other_cpu_pct'])} |")


def cpu_windows(samples: list[dict], width: float = 0.5) -> tuple[list[float], list[float]]:
    """CPU (daemon + children, % of one vCPU) over consecutive windows of `width` seconds."""
    edges, values = [], []
    if not samples:
        return edges, values
    a = samples[0]["t"]
    while a + width <= samples[-1]["t"] + 1e-9:
        c = cpu_pct(samples, a, a + width + 1e-6)
        edges.append(a)
        values.append(c["total"] if c else 0.0)
        a += width
    return edges, values


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = results["meta"]
    runs = [r for r in results["runs"] if r["round"] == 0]
    fig, axes = plt.subplots(3, len(runs), figsize=(4.2 * len(runs) + 1, 8.5), sharex=True, sharey="row",
                             squeeze=False)
    low, high = m["low_seconds"], m["low_seconds"] + m["high_seconds"]
    after = high + m["after_seconds"]
    for col, run in enumerate(runs):
        ax_rps, ax_kids, ax_cpu = axes[0][col], axes[1][col], axes[2][col]
        end = run["end_s"]
        last_t = max(run["samples"][-1]["t"], after + 0.1, end + 1.0)
        # A last line of a few ms (the replies after the last tick) would show as a spike.
        ps = [p for p in run["per_second"] if p["t_end"] - p["t_start"] >= 0.5]
        ax_rps.stairs([p["rps"] for p in ps], [ps[0]["t_start"]] + [p["t_end"] for p in ps], color="tab:blue",
                      linewidth=2, alpha=0.8, label="rps (per second)")
        ax_rps.stairs([0, m["low"], m["high"], m["low"], 0], [-0.5, 0, low, high, after, last_t], color="black",
                      linestyle="--", linewidth=0.8, label="target", zorder=3)
        f = run["figures"]
        ax_rps.set_title(f"{run['kind'].split(':')[0]}: step {f['step_rps_first_second']:.0f} rps "
                         f"({f['step_fraction_of_target']:.0%} of target)"
                         if f["step_rps_first_second"] else run["kind"].split(":")[0], fontsize=9)
        pool = [s for s in run["samples"] if s["children"] is not None]
        ts = [s["t"] for s in pool]
        ax_kids.step(ts, [s["children"] for s in pool], where="post", color="tab:green", label="children")
        ax_kids.step(ts, [s["spinning"] for s in pool], where="post", color="tab:red", linestyle="-.",
                     label="spinning children")
        edges, values = cpu_windows(run["samples"])
        if edges:
            ax_cpu.stairs(values, edges + [edges[-1] + 0.5], color="tab:purple", label="daemon + children")
        idle = f["cpu_pct_idle"]
        ax_cpu.text(0.98, 0.9, f"idle (from 1 s after): {idle}%" if idle is not None else "idle: -",
                    transform=ax_cpu.transAxes, ha="right", fontsize=8)
        for ax in (ax_rps, ax_kids, ax_cpu):
            for x in (low, high):
                ax.axvline(x, color="grey", linewidth=0.6)
            ax.axvline(end, color="black", linestyle="--", linewidth=0.8)
            ax.axvspan(end + 1.0, last_t, color="grey", alpha=0.12)
            ax.grid(alpha=0.3)
        ax_cpu.set_xlabel("seconds since the start of the run")
    axes[0][0].set_ylabel("GetPage requests/s")
    axes[1][0].set_ylabel("redo children")
    axes[2][0].set_ylabel("CPU, % of one vCPU (0.5 s)")
    axes[1][0].yaxis.get_major_locator().set_params(integer=True)
    for row in axes:
        row[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{m['scenario']}, {m['connections']} connections: {m['low']:g} -> {m['high']:g} -> {m['low']:g} "
                 f"requests/s, then idle; round 1 ({m['date']}, {m['commit']})\n"
                 "dashed: the last reply; shaded: from 1 s after it (the idle CPU figure)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", file=sys.stderr)


def parse_options():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", type=Path, default=Path("target/release"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="PNG of round 1 (needs matplotlib)")
    parser.add_argument("--scenario", default="chain10", choices=sorted(measure.SCENARIOS))
    parser.add_argument("--kinds", default="sync:compaction=off:page_cache_size=0,async:compaction=off:page_cache_size=0,"
                                           "auto:compaction=off:page_cache_size=0",
                        help="daemon variants, comma separated: a walredo process kind, optionally with more "
                             "settings after colons (as in measure.py)")
    parser.add_argument("--low", type=float, default=2900.0, help="requests/s before and after the step")
    parser.add_argument("--high", type=float, default=29000.0, help="requests/s during the step")
    parser.add_argument("--low-seconds", type=float, default=4.0, help="seconds at --low before the step")
    parser.add_argument("--high-seconds", type=float, default=6.0, help="seconds at --high")
    parser.add_argument("--after-seconds", type=float, default=3.0, help="seconds at --low after the step")
    parser.add_argument("--idle-seconds", type=float, default=3.0,
                        help="seconds of sampling without load after the last request")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs per kind; the median is reported")
    parser.add_argument("--quiet-below", type=float, default=15.0,
                        help="before each run, wait until the machine's busy CPU is below this %% of one CPU")
    parser.add_argument("--quiet-max-wait", type=float, default=600.0)
    parser.add_argument("--keep", action="store_true", help="keep the daemons' work dirs (logs, series files)")
    opts = parser.parse_args()
    for name in ("low", "high", "low_seconds", "high_seconds", "after_seconds"):
        if not getattr(opts, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be above 0")
    if opts.idle_seconds < 0 or opts.connections < 1 or opts.rounds < 1:
        parser.error("--idle-seconds must be at least 0, --connections and --rounds at least 1")
    kinds = [k for k in opts.kinds.split(",") if k]
    if not kinds or len(set(kinds)) != len(kinds):
        parser.error(f"--kinds must name at least one variant, each once: {opts.kinds!r}")
    if not (opts.bin_dir / "pageserver").exists() or not (opts.bin_dir / "pagebench").exists():
        parser.error(f"--bin-dir {opts.bin_dir} has no pageserver and pagebench binaries")
    return opts, kinds


def main() -> int:
    # SIGTERM and SIGINT unwind through the `finally` that stops the daemons.
    signal.signal(signal.SIGTERM, measure._interrupt)
    signal.signal(signal.SIGINT, measure._interrupt)
    opts, kinds = parse_options()
    if opts.plot:
        try:
            import matplotlib  # noqa: F401 - fail now rather than after the runs
        except ImportError:
            print("--plot needs matplotlib: pip install -r test_runner/performance/requirements.txt",
                  file=sys.stderr)
            return 2
    scenario = measure.SCENARIOS[opts.scenario]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            timeout=10).stdout.strip()
    results: dict = {"meta": {"date": datetime.date.today().isoformat(), "commit": commit,
                              "machine": f"{measure.os.cpu_count()} vCPU",
                              # The options, without the paths of this machine.
                              **{k: v for k, v in vars(opts).items() if k not in ("out", "plot", "bin_dir")}},
                     "runs": []}
    daemons: dict[str, measure.Daemon] = {}
    try:
        # One daemon per kind, alive together; the order of the runs rotates each round.
        for kind in kinds:
            process_kind, *settings = kind.split(":")
            daemons[kind] = daemon = measure.Daemon(opts.bin_dir, [f"walredo_process_kind={process_kind}", *settings,
                                                                   *scenario["config"]])
            print(f"== {opts.scenario} {kind}: daemon pid {daemon.pid} in {daemon.workdir}", file=sys.stderr)
            ingest = measure.finish(measure.pagebench(opts.bin_dir, daemon, ["ingest", "--tenant", TENANT,
                                                                             *scenario["shape"]]), 600)
            print(f"   ingest {ingest}", file=sys.stderr)
            pool_of(tenant_status(daemon))
        for r in range(opts.rounds):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                run = run_once(opts, scenario, daemons[kind], kind, r)
                results["runs"].append(run)
                f = run["figures"]
                print(f"   {kind} round {r + 1}: step {f['step_rps_first_second']} rps (p99 {f['step_p99_us']} us), "
                      f"high {f['high_rps_mean']} rps, children high {f['high_children_max']} "
                      f"after {f['after_children']}/{f['after_spinning']} idle {f['idle_children']}/"
                      f"{f['idle_spinning']}, CPU % low {f['cpu_pct_low']} high {f['cpu_pct_high']} after "
                      f"{f['cpu_pct_after']} idle {f['cpu_pct_idle']}, no child spins after "
                      f"{f['seconds_until_no_child_spins']} s, other CPU {f['other_cpu_pct']}%", file=sys.stderr)
                opts.out.write_text(json.dumps(results, indent=1, default=str))
    finally:
        for daemon in daemons.values():
            daemon.stop(keep=opts.keep)
    results["kinds"] = summarize(results["runs"], kinds, opts.rounds)
    opts.out.write_text(json.dumps(results, indent=1, default=str))
    if opts.plot:
        plot(results, opts.plot)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
