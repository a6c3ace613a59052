#!/usr/bin/env python3
"""Measures the compactor (docs/performance.md, "Compaction"): what it costs GetPage under a
steady write load, and what it buys.

Not a test (pytest collects only test_*.py): a script to reproduce the published tables.

    cargo build --release --bins
    .venv/bin/pip install -r test_runner/performance/requirements.txt   # matplotlib, for the plot
    .venv/bin/python test_runner/performance/compaction_mixed.py --out compaction.json --plot compaction.png

Three parts, each chosen with --parts (default: all):

- `mixed`: a steady write load (pagebench ingest --rate: one record per page per round, over a
  working set of --blocks pages) plus open-loop GetPage at --get-rate over --connections
  connections at the latest LSN, for --duration seconds, once per compaction mode
  (`off`, `monolithic`, `sliced`), with the modes alternating over --rounds rounds (the order
  rotates each round). Every run starts from a fresh daemon holding the same data set, compacted
  once by POST /v1/tenant/{id}/compact, so that all modes start equal. While it runs, the
  tenant's status is sampled every 0.5 s (backlog, share, layers, disk bytes, compaction totals).
  When the writes stop, the status is sampled on for up to --drain seconds, until the backlog is
  under 1.0 (no pass due) and no pass runs. Reported per run: GetPage p50/p99/p99.9 and rps (from
  the scheduled send time, so a stalled daemon is not understated), compaction throughput
  (bytes rewritten per second of the run), the largest and the final disk bytes against the
  live data (one image per page) plus the retention window (the bytes ingested within
  gc_horizon), and the seconds from the end of the writes until the backlog was under threshold.
  The ratios sliced/off and monolithic/off are taken within each round and their medians
  quoted.
- `chains`: GetPage rate (closed loop, --chain-connections connections, no page cache) at the
  latest LSN after 10 and after 200 records per page, with compaction `sliced` (the default; the
  daemon compacts by itself, the script waits for it) and, for comparison, chain 10 with
  compaction `off` (the state of the issue's "Why"). The daemons run side by side and their runs
  alternate. Then one run per daemon under `strace -c -f`: syscalls per GetPage. With
  `--chain-builds A,B`, builds side by side instead: a chain-10 and a chain-200 daemon (both
  `sliced`) of each build, all runs alternated, and the ratio chain 200 / chain 10 per build
  (pagebench from --bin-dir; no strace). `--short-chain 0` makes the short-chain tenants images
  alone: since passes image a page by the bytes of its records, 10 records of 51 bytes stay
  records, and the chain-10 tenant's reads are redos.
- `threshold`: what a record above the newest image costs a GetPage once a pass has merged the
  layers (compaction_image_threshold=65536, so no pass makes images): GetPage rate at chains of
  1, 8, 32 and 128 records per page, alternating. It is the measurement behind the default of
  compaction_image_threshold.

Every daemon started is stopped (SIGTERM, then SIGKILL after 30 s) and its work dir removed
(unless --keep) before the script exits. strace must be installed
for the syscall counts (skipped with a note otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the sibling script's daemon, pagebench and sampling helpers

TENANT = "bench"
MODES = ["off", "monolithic", "sliced"]
LSN_STEP = 8  # pagebench's dataset: LSN distance between consecutive values
RECORD_BYTES = 64  # about one ingested record on disk (key, LSN, kind, length, record, index)


def http_json(http: str, method: str, path: str, timeout: float = 600) -> dict:
    request = urllib.request.Request(f"http://{http}{path}", method=method)
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read().decode() or "null")


def tenant_status(daemon: measure.Daemon) -> dict:
    return http_json(daemon.http, "GET", f"/v1/tenant/{TENANT}", timeout=10)


def shape_args(blocks: int, chain: int) -> list[str]:
    return ["--relations", "1", "--blocks", str(blocks), "--chain-length", str(chain)]


def load(opts, daemon: measure.Daemon, blocks: int, chain: int) -> dict:
    return measure.finish(measure.pagebench(opts.bin_dir, daemon, ["ingest", "--tenant", TENANT,
                                                                   *shape_args(blocks, chain)]), 900)


class StatusSampler(threading.Thread):
    """Samples the tenant's status and the daemon's CPU every 0.5 s until stopped."""

    def __init__(self, daemon: measure.Daemon, t0: float):
        super().__init__(daemon=True)
        self.daemon_proc = daemon
        self.t0 = t0
        self.samples: list[dict] = []
        self.stop_event = threading.Event()

    def sample(self) -> dict:
        status = tenant_status(self.daemon_proc)
        c, s = status["compaction"], status["storage"]
        kids = self.daemon_proc.redo_children()
        return {
            "t": round(time.monotonic() - self.t0, 2),
            "backlog": c["backlog"], "share": c["share"], "guard": c["guard"], "running": c["running"],
            "passes": c["passes"], "bytes_rewritten": c["bytes_rewritten"],
            "images_created": c["images_created"], "gc_cutoff": c["gc_cutoff"],
            "layers": s["layers"], "disk_bytes": s["disk_bytes"], "values": s["values"],
            "last_durable_lsn": status["last_durable_lsn"],
            "daemon_cpu_ticks": measure.read_cpu_ticks(self.daemon_proc.pid) or 0,
            "redo_cpu_ticks": sum(measure.read_cpu_ticks(k) or 0 for k in kids),
        }

    def run(self) -> None:
        while True:
            try:
                self.samples.append(self.sample())
            except Exception as e:  # noqa: BLE001 - a failed sample is a gap, not the end
                print(f"   status sample failed: {e}", file=sys.stderr)
            if self.stop_event.wait(0.5):
                return


def pass_seconds(samples: list[dict]) -> float:
    """Seconds during which a pass ran, from the status samples."""
    return sum(b["t"] - a["t"] for a, b in zip(samples, samples[1:]) if a["running"])


def read_series(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_mixed(opts, mode: str) -> dict:
    """One run of the mixed workload with compaction `mode`, from a fresh daemon."""
    gc_horizon = int(opts.window_seconds * opts.write_rate * LSN_STEP)
    daemon = measure.Daemon(opts.bin_dir, [f"compaction={mode}", "page_cache_size=0",
                                           f"gc_horizon={gc_horizon}"])
    try:
        print(f"== mixed {mode}: daemon pid {daemon.pid}", file=sys.stderr)
        load(opts, daemon, opts.blocks, opts.initial_chain)
        start_pass = http_json(daemon.http, "POST", f"/v1/tenant/{TENANT}/compact")["pass"]
        busy = measure.wait_for_quiet_machine(opts.quiet_below, opts.quiet_max_wait)
        rounds = opts.initial_chain + int(opts.duration * opts.write_rate / opts.blocks) + 2
        series_path = daemon.workdir / "series.jsonl"
        t0 = time.monotonic()
        sampler = StatusSampler(daemon, t0)
        sampler.start()
        ingest = measure.pagebench(opts.bin_dir, daemon, [
            "ingest", "--tenant", TENANT, *shape_args(opts.blocks, min(rounds, 10_000)), "--exists-ok",
            "--rate", str(opts.write_rate), "--duration", str(opts.duration), "--in-flight", "2"])
        get_page = measure.pagebench(opts.bin_dir, daemon, [
            "get-page", "--tenant", TENANT, "--lsn", "latest", "--connections", str(opts.connections),
            "--rate", f"{opts.get_rate}:{opts.duration}s", "--series", str(series_path),
            "--timeout", "30"])
        ingested = measure.finish(ingest, opts.duration + 120)
        writes_end = time.monotonic() - t0
        got = measure.finish(get_page, opts.duration + 120)
        # Drain: until no pass is due or running (or --drain seconds).
        under_at = None
        deadline = time.monotonic() + opts.drain
        while time.monotonic() < deadline:
            last = sampler.samples[-1] if sampler.samples else None
            if last and last["t"] > writes_end and last["backlog"] < 1.0 and not last["running"]:
                under_at = round(last["t"] - writes_end, 1)
                break
            if mode == "off":
                break  # nothing drains it
            time.sleep(0.5)
        sampler.stop_event.set()
        sampler.join()
        samples = sampler.samples
        during = [s for s in samples if s["t"] <= writes_end]
        first, last_during = during[0], during[-1]
        live = opts.blocks * 8192
        window = int(opts.window_seconds * opts.write_rate * RECORD_BYTES)
        cpu = lambda key: round(100.0 * (last_during[key] - first[key]) / measure.CLK_TCK  # noqa: E731
                                / max(last_during["t"] - first["t"], 1e-9), 1)
        return {
            "mode": mode,
            "machine_busy_before_pct": busy,
            "start_pass": start_pass,
            "ingest": ingested,
            "get_page": got,
            "series": read_series(series_path),
            "status": samples,
            "writes_end_s": round(writes_end, 2),
            "seconds_to_under_threshold": under_at,
            # Over the run and the drain: bytes rewritten per second of the run, and per second
            # of pass time (the samples during which a pass ran).
            "compaction_bytes_per_s": round((samples[-1]["bytes_rewritten"] - first["bytes_rewritten"])
                                            / max(samples[-1]["t"] - first["t"], 1e-9)),
            "compaction_bytes_per_pass_s": round((samples[-1]["bytes_rewritten"] - first["bytes_rewritten"])
                                                 / max(pass_seconds(samples), 0.5)),
            "passes": samples[-1]["passes"] - first["passes"],
            "images_created": samples[-1]["images_created"] - first["images_created"],
            "disk_bytes_max": max(s["disk_bytes"] for s in samples),
            "disk_bytes_end": samples[-1]["disk_bytes"],
            "live_plus_window_bytes": live + window,
            "backlog_max": max(s["backlog"] for s in during),
            "daemon_cpu_pct": cpu("daemon_cpu_ticks"),
            "redo_cpu_pct": cpu("redo_cpu_ticks"),
        }
    finally:
        daemon.stop(keep=opts.keep)


def part_mixed(opts) -> dict:
    runs = []
    for r in range(opts.rounds):
        order = MODES[r % 3:] + MODES[:r % 3]
        for mode in order:
            run = run_mixed(opts, mode)
            run["round"] = r
            runs.append(run)
            lat = run["get_page"]["latency_us"]
            print(f"   {mode:<10} round {r}: rps {run['get_page']['rps']} p50 {lat['p50']} p99 {lat['p99']} "
                  f"p99.9 {lat['p999']} errors {run['get_page']['errors']} late {run['get_page'].get('late')} "
                  f"compaction {run['compaction_bytes_per_s']} B/s, {run['passes']} passes, disk max "
                  f"{run['disk_bytes_max']} end {run['disk_bytes_end']} (live+window {run['live_plus_window_bytes']}), "
                  f"under threshold after {run['seconds_to_under_threshold']} s", file=sys.stderr)
    ratios = {}
    for mode in ("monolithic", "sliced"):
        for q in ("p50", "p99", "p999"):
            per_round = []
            for r in range(opts.rounds):
                base = next(x for x in runs if x["round"] == r and x["mode"] == "off")
                this = next(x for x in runs if x["round"] == r and x["mode"] == mode)
                per_round.append(this["get_page"]["latency_us"][q] / max(base["get_page"]["latency_us"][q], 1))
            ratios[f"{mode}/off {q}"] = {"median": round(statistics.median(per_round), 3),
                                         "rounds": [round(x, 3) for x in per_round]}
    return {"runs": runs, "ratios": ratios}


def closed_loop(opts, daemon, seconds: float) -> dict:
    return measure.finish(measure.pagebench(opts.bin_dir, daemon, [
        "get-page", "--tenant", TENANT, "--lsn", "latest", "--connections", str(opts.chain_connections),
        "--duration", str(seconds)]), seconds + 120)


def wait_compacted(daemon: measure.Daemon, limit: float) -> float | None:
    """Seconds until the daemon's own compactor has no pass due or running, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        c = tenant_status(daemon)["compaction"]
        if c["backlog"] < 1.0 and not c["running"] and c["passes"] > 0:
            return round(time.monotonic() - t0, 1)
        time.sleep(0.5)
    return None


def alternate(opts, daemons: dict[str, measure.Daemon]) -> dict:
    rps = {name: [] for name in daemons}
    summaries = {name: [] for name in daemons}
    for _ in range(opts.repeat):
        for name, daemon in daemons.items():
            measure.wait_for_quiet_machine(opts.quiet_below, opts.quiet_max_wait)
            s = closed_loop(opts, daemon, opts.point_seconds)
            rps[name].append(s["rps"])
            summaries[name].append(s)
            print(f"   {name:<16} rps {s['rps']} p50 {s['latency_us']['p50']} p99 {s['latency_us']['p99']}",
                  file=sys.stderr)
    out = {}
    for name in daemons:
        ordered = sorted(summaries[name], key=lambda s: s["rps"])
        out[name] = {"rps_median": statistics.median(rps[name]), "rps_runs": rps[name],
                     "median_run": ordered[len(ordered) // 2]}
    return out


def part_chains(opts) -> dict:
    builds = [Path(b) for b in opts.chain_builds.split(",")] if opts.chain_builds else []
    if builds:
        setups = {f"{tag}{i}": (chain, "sliced", b) for i, b in enumerate(builds)
                  for tag, chain in (("chain10-build", opts.short_chain), ("chain200-build", 200))}
    else:
        setups = {"chain10-sliced": (opts.short_chain, "sliced", opts.bin_dir),
                  "chain200-sliced": (200, "sliced", opts.bin_dir), "chain10-off": (opts.short_chain, "off", opts.bin_dir)}
    daemons: dict[str, measure.Daemon] = {}
    result: dict = {"blocks": opts.chain_blocks, "connections": opts.chain_connections}
    try:
        for name, (chain, mode, bin_dir) in setups.items():
            daemons[name] = d = measure.Daemon(bin_dir, [f"compaction={mode}", "page_cache_size=0"])
            print(f"== chains {name}: daemon pid {d.pid}", file=sys.stderr)
            load(opts, d, opts.chain_blocks, chain)
            if mode != "off" and chain == 0:
                # Images alone give the compactor no pass to make: one asked for, so that they
                # too are read from a compacted layer.
                http_json(d.http, "POST", f"/v1/tenant/{TENANT}/compact")
            if mode != "off":
                waited = wait_compacted(d, 300)
                result[f"{name} compacted after s"] = waited
                print(f"   compacted by itself after {waited} s", file=sys.stderr)
        result["rates"] = alternate(opts, daemons)
        if builds:
            for i in range(len(builds)):
                rates = result["rates"]
                result[f"chain200/chain10 build{i}"] = round(
                    rates[f"chain200-build{i}"]["rps_median"] / rates[f"chain10-build{i}"]["rps_median"], 3)
                # Run by run (the daemons of one round ran one after the other): the median.
                pairs = zip(rates[f"chain200-build{i}"]["rps_runs"], rates[f"chain10-build{i}"]["rps_runs"])
                result[f"chain200/chain10 build{i} per round"] = [round(a / b, 3) for a, b in pairs]
            return result
        base = result["rates"]["chain10-sliced"]["rps_median"]
        result["chain200/chain10 (sliced)"] = round(result["rates"]["chain200-sliced"]["rps_median"] / base, 3)
        result["chain10 sliced/off"] = round(base / result["rates"]["chain10-off"]["rps_median"], 3)
        if shutil.which("strace"):
            scenario = {"shape": shape_args(opts.chain_blocks, 10), "lsn": "latest"}
            for name in ("chain10-off", "chain10-sliced"):
                result[f"strace {name}"] = measure.run_strace(opts.bin_dir, daemons[name], scenario, 8, 1)
                # measure.run_strace names the tenant "bench" too.
                print(f"   strace {name}: {result[f'strace {name}']}", file=sys.stderr)
        else:
            result["strace"] = "strace not installed: no syscall counts"
    finally:
        for d in daemons.values():
            d.stop(keep=opts.keep)
    return result


def part_threshold(opts) -> dict:
    chains = [1, 8, 32, 128]
    daemons: dict[str, measure.Daemon] = {}
    try:
        for chain in chains:
            name = f"chain{chain}"
            daemons[name] = d = measure.Daemon(opts.bin_dir, ["compaction=off", "page_cache_size=0",
                                                             "compaction_image_threshold=65536"])
            print(f"== threshold {name}: daemon pid {d.pid}", file=sys.stderr)
            load(opts, d, opts.chain_blocks, chain)
            http_json(d.http, "POST", f"/v1/tenant/{TENANT}/compact")
        rates = alternate(opts, daemons)
        base = rates["chain1"]["rps_median"]
        return {"rates": rates, "relative_to_chain1": {n: round(r["rps_median"] / base, 3) for n, r in rates.items()}}
    finally:
        for d in daemons.values():
            d.stop(keep=opts.keep)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["mixed"]["runs"] if r["round"] == 0]
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    colors = {"off": "tab:blue", "monolithic": "tab:red", "sliced": "tab:green"}
    for run in runs:
        c = colors[run["mode"]]
        series = run["series"]
        axes[0].plot([p["t"] for p in series], [p["latency_us"]["p99"] / 1000 for p in series], color=c,
                     label=f"{run['mode']} p99")
        axes[0].plot([p["t"] for p in series], [p["latency_us"]["max"] / 1000 for p in series], color=c,
                     linestyle=":", alpha=0.6, label=f"{run['mode']} max")
        st = run["status"]
        axes[1].plot([s["t"] for s in st], [s["backlog"] for s in st], color=c, label=f"{run['mode']} backlog")
        axes[1].fill_between([s["t"] for s in st], 0, [s["share"] * 4 for s in st], color=c, alpha=0.15,
                             step="post", label=f"{run['mode']} CPU share x4")
        axes[2].plot([s["t"] for s in st], [s["disk_bytes"] / 2**20 for s in st], color=c, label=run["mode"])
    live_window = runs[0]["live_plus_window_bytes"] / 2**20
    axes[2].axhline(2 * live_window, color="grey", linestyle="--", label="2 x (live + window)")
    axes[0].set_ylabel("GetPage latency, ms (per second)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("backlog (1.0 = pass due)")
    axes[2].set_ylabel("disk, MiB")
    axes[2].set_xlabel("seconds (writes stop at the dashed line)")
    for ax in axes:
        ax.axvline(runs[0]["writes_end_s"], color="black", linestyle="--", linewidth=0.8)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    m = results["meta"]
    fig.suptitle(f"Compaction under a steady write load: {m['write_rate']} records/s over {m['blocks']} pages, "
                 f"GetPage {m['get_rate']}/s over {m['connections']} connections ({m['date']}, {m['commit']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", file=sys.stderr)


def print_tables(results: dict) -> None:
    if "mixed" in results:
        print("| round | mode | GetPage rps | p50 us | p99 us | p99.9 us | errors | passes | rewritten MB/s (of pass time) "
              "| disk max MiB | disk end MiB | 2 x (live + window) MiB | under threshold after s | daemon CPU % |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in results["mixed"]["runs"]:
            g = r["get_page"]
            print(f"| {r['round']} | {r['mode']} | {g['rps']:.0f} | {g['latency_us']['p50']} | {g['latency_us']['p99']} "
                  f"| {g['latency_us']['p999']} | {g['errors']} | {r['passes']} "
                  f"| {r['compaction_bytes_per_s'] / 1e6:.2f} ({r['compaction_bytes_per_pass_s'] / 1e6:.1f}) "
                  f"| {r['disk_bytes_max'] / 2**20:.1f} "
                  f"| {r['disk_bytes_end'] / 2**20:.1f} | {2 * r['live_plus_window_bytes'] / 2**20:.1f} "
                  f"| {r['seconds_to_under_threshold']} | {r['daemon_cpu_pct']} |")
        for name, v in results["mixed"]["ratios"].items():
            print(f"- {name}: median {v['median']} (rounds {v['rounds']})")
    for part in ("chains", "threshold"):
        if part in results:
            print(f"\n{part}: {json.dumps({k: v for k, v in results[part].items() if k != 'rates'})}")
            for name, r in results[part]["rates"].items():
                s = r["median_run"]
                print(f"- {name}: rps median {r['rps_median']} (runs {r['rps_runs']}), p50 {s['latency_us']['p50']} us, "
                      f"p99 {s['latency_us']['p99']} us")


def main() -> int:
    # SIGTERM and SIGINT unwind through the `finally` that stops the daemons.
    signal.signal(signal.SIGTERM, measure._interrupt)
    signal.signal(signal.SIGINT, measure._interrupt)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", type=Path, default=Path("target/release"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="PNG of the mixed part's first round (needs matplotlib)")
    parser.add_argument("--parts", default="mixed,chains,threshold")
    parser.add_argument("--rounds", type=int, default=2, help="mixed: rounds of the three modes")
    parser.add_argument("--duration", type=float, default=60.0, help="mixed: seconds of writes and reads")
    parser.add_argument("--drain", type=float, default=60.0, help="mixed: seconds to wait for the backlog after")
    parser.add_argument("--blocks", type=int, default=2000, help="mixed: pages in the working set")
    parser.add_argument("--initial-chain", type=int, default=8, help="mixed: records per page before the run")
    parser.add_argument("--write-rate", type=float, default=1000.0, help="mixed: records per second")
    parser.add_argument("--get-rate", type=float, default=3000.0, help="mixed: GetPage per second (open loop)")
    parser.add_argument("--connections", type=int, default=8, help="mixed: GetPage connections")
    parser.add_argument("--window-seconds", type=float, default=10.0,
                        help="mixed: gc_horizon, in seconds of the write load")
    parser.add_argument("--chain-blocks", type=int, default=500, help="chains, threshold: pages")
    parser.add_argument("--chain-connections", type=int, default=8, help="chains, threshold: connections")
    parser.add_argument("--point-seconds", type=float, default=10.0, help="chains, threshold: seconds per run")
    parser.add_argument("--repeat", type=int, default=3, help="chains, threshold: runs per daemon (median)")
    parser.add_argument("--chain-builds", help="chains: build dirs to compare, comma separated (see above)")
    parser.add_argument("--short-chain", type=int, default=10,
                        help="chains: records per page of the short-chain tenants (named chain10 whatever it is; "
                             "0: images alone, what a read of one image costs)")
    parser.add_argument("--quiet-below", type=float, default=15.0)
    parser.add_argument("--quiet-max-wait", type=float, default=600.0)
    parser.add_argument("--keep", action="store_true", help="keep the daemons' work dirs")
    opts = parser.parse_args()
    if opts.plot:
        import matplotlib  # noqa: F401 - fail now rather than after the runs

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results: dict = {"meta": {"date": datetime.date.today().isoformat(), "commit": commit,
                              "machine": f"{measure.os.cpu_count()} vCPU",
                              # The options, without the paths of this machine.
                              **{k: str(v) for k, v in vars(opts).items() if k not in ("out", "plot", "bin_dir", "chain_builds")}}}
    results["meta"].update(blocks=opts.blocks, write_rate=opts.write_rate, get_rate=opts.get_rate,
                           connections=opts.connections)
    parts = opts.parts.split(",")
    for part, fn in (("mixed", part_mixed), ("chains", part_chains), ("threshold", part_threshold)):
        if part in parts:
            results[part] = fn(opts)
            opts.out.write_text(json.dumps(results, indent=1))
    if opts.plot and "mixed" in results:
        plot(results, opts.plot)
    print_tables(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
