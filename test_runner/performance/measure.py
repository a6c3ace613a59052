#!/usr/bin/env python3
"""Runs the pagebench matrix of docs/performance.md and records what bounds each figure.

Not a test (pytest collects only test_*.py): a script to reproduce the published table.

    cargo build --release --bins
    python3 test_runner/performance/measure.py --bin-dir target/release --out pagebench.json

For each scenario and each walredo process kind it starts a fresh daemon in a temp work dir (free
ports), loads the scenario's data set with `pagebench ingest`, optionally warms up, then runs
`pagebench get-page` --repeat times per point and reports the run with the median throughput;
the daemon's CPU per request of every run is kept too (`daemon_us_runs`), and the table gives
their median beside the median run's (the two can differ on a noisy machine).
The kind `floor` is not the daemon but `page-floor` (build it with `cargo build --release -p
benches --bin page-floor`), the loopback floor that answers every GetPage with a constant page:
its runs alternate with the others', and the table's last column gives each run's rps as a
ratio to the floor's at the same point. A
point is a closed loop (connections x depth) or an open loop (connections x @rate: pagebench
`--rate`, for CPU per request at a given load). The daemons of both process kinds run side by side (idle when not measured)
and their runs alternate, so that a drift in the machine's speed (it is a shared VM) hits both
kinds alike. While a run goes, it samples /proc every 0.5 s: the machine's CPU split
(/proc/stat), and the CPU time and context switches of the daemon, of its redo children, and of
pagebench itself (the daemon's CPU also split into user and kernel time: what the kernel takes per
request bounds how far user-space work can lower the total); the daemon's /metrics are read before and after. Samples from the first second
are dropped (ramp-up).

The machine is shared (other sessions build and benchmark on the same 2 vCPUs), so before each
run the script waits for the machine to be quiet (--quiet-below), and a run during which other
processes used more than --max-other-cpu, or the hypervisor stole more than --max-steal, is
discarded and redone (at most --repeat discards per point).

With --strace, one extra run per scenario and kind is made under `strace -c -f` on the daemon and
its redo child, and the syscall counts are divided by the requests served meanwhile; that run's
throughput is not reported (strace slows everything down).

Every daemon started is stopped (SIGTERM, then SIGKILL after 30 s) and its work dir removed
(unless --keep) before the script exits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
# pagebench's tenant flags: `bench`, or with --tenants N > 1, `bench-0` .. `bench-<N-1>`.
TENANT_ARGS = ["--tenant", "bench"]

SCENARIOS = {
    # A small working set that fits the default page cache, asked at the latest LSN: after the
    # warm-up every request is a cache hit.
    "cached": {
        "config": [],
        "shape": ["--relations", "1", "--blocks", "1024", "--chain-length", "10"],
        "lsn": "latest",
        "warmup": 3.0,
    },
    # Many small tenants (--tenants), each of 200 pages x chain 10, every request a redo: the
    # daemon-wide spin budget's case (one busy connection per tenant).
    "small-chain10": {
        "config": ["page_cache_size=0", "compaction=off"],
        "shape": ["--relations", "1", "--blocks", "200", "--chain-length", "10"],
        "lsn": "latest",
        "warmup": 0.0,
    },
    # Every request rebuilds the page from its image and 10 records in the redo child, for as
    # long as compaction leaves the data set alone: at the latest LSN its image policy soon
    # makes an image of every page, and then `chain10` measures reads of images.
    "chain10": {
        "config": ["page_cache_size=0"],
        "shape": ["--relations", "10", "--blocks", "1000", "--chain-length", "10"],
        "lsn": "latest",
        "warmup": 0.0,
    },
    # `chain10` with compaction off: every request stays a redo, however long the runs go.
    "chain10-redo": {
        "config": ["page_cache_size=0", "compaction=off"],
        "shape": ["--relations", "10", "--blocks", "1000", "--chain-length", "10"],
        "lsn": "latest",
        "warmup": 0.0,
    },
}


def scenario_of(name: str) -> dict:
    """The scenario `name`: one of SCENARIOS, or `chain<N>-redo` (`chain10-redo` with chains of N
    records), or `chain<N>-compacted` (the same after one compaction pass that makes no images:
    each page's values adjacent in one layer, as passes leave a chain they do not image): what a
    GetPage's redo costs against the chain's length; or `chain<N>-imaged` (the same after one
    pass with the default image policy, which images a page once its records outweigh it: a
    page of a long history then reads one image under its records in the layer, and
    `chain1-imaged`, an image alone, is what such a read should cost)."""
    m = re.fullmatch(r"chain(\d+)-(redo|compacted|imaged)", name)
    if name in SCENARIOS or not m:
        return SCENARIOS[name]
    shape = list(SCENARIOS["chain10-redo"]["shape"])
    shape[shape.index("--chain-length") + 1] = m.group(1)
    if m.group(2) == "redo":
        return {**SCENARIOS["chain10-redo"], "shape": shape}
    config = list(SCENARIOS["chain10-redo"]["config"])
    if m.group(2) == "compacted":
        config.append("compaction_image_threshold=65536")
    return {**SCENARIOS["chain10-redo"], "shape": shape, "config": config, "compact": True}


def read_cpu_split(pid: int) -> tuple[int, int] | None:
    """The user and the kernel CPU ticks of `pid` (utime and stime, fields 14 and 15)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[11]), int(rest[12])


def read_cpu_ticks(pid: int) -> int | None:
    split = read_cpu_split(pid)
    return sum(split) if split else None


def read_ctx_switches(pid: int) -> tuple[int, int]:
    vol = invol = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0, 0
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        vol += int(re.search(r"voluntary_ctxt_switches:\s+(\d+)", text).group(1))
        invol += int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", text).group(1))
    return vol, invol


def children(ppid: int, comm: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        c = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()
        if int(rest[1]) == ppid and c == comm and rest[0] not in ("Z", "X"):
            out.append(int(name))
    return out


def read_system_cpu() -> dict[str, int]:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]
    return {n: int(v) for n, v in zip(names, fields)}


def metrics(http: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:  # page-floor has no metrics
            return {}
        raise
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def parse_cpus(spec: str) -> set[int]:
    """CPUs of a `taskset -c` style list: `0-3,8`."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


class Daemon:
    def __init__(self, bin_dir: Path, config: list[str], floor_shape: list[str] | None = None,
                 workdir: Path | None = None, cpus: str | None = None, env: dict[str, str] | None = None):
        """The daemon with `config`; or, given `floor_shape` (pagebench's shape flags), the
        loopback floor `page-floor` answering for that data set (benches/src/bin/page-floor.rs).
        In `workdir` if given (a kept work dir: its tenants are loaded), else in a new one.
        With `cpus` (a `taskset -c` style list), it and its redo children run on those CPUs only
        (its runtime sizes itself to them). `env`: variables added to its environment."""
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="pagebench-daemon-"))
        (self.workdir / "ports.json").unlink(missing_ok=True)
        if floor_shape is not None:
            args = [str(bin_dir / "page-floor"), "--workdir", str(self.workdir), *floor_shape, *config]
        else:
            args = [str(bin_dir / "pageserver"), "-D", str(self.workdir),
                    "-c", "listen_pg_addr=127.0.0.1:0", "-c", "listen_http_addr=127.0.0.1:0"]
            for c in config:
                args += ["-c", c]
        self.args = args
        self.log = open(self.workdir / "pageserver.log", "ab" if workdir else "wb")
        pin = (lambda: os.sched_setaffinity(0, parse_cpus(cpus))) if cpus else None
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=pin, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 30
        ports = self.workdir / "ports.json"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited at start-up, see {self.workdir}/pageserver.log")
            try:
                p = json.loads(ports.read_text())
                self.pg, self.http = p["pg"], p["http"]
                break
            except (FileNotFoundError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("daemon did not write ports.json in 30 s")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def redo_children(self) -> list[int]:
        return children(self.pid, "walredo-proc")

    def stop(self, keep: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


class Sampler(threading.Thread):
    """Samples CPU of the daemon, its redo children, pagebench and the machine."""

    def __init__(self, daemon: Daemon, bench_pid: int, skip: float):
        super().__init__(daemon=True)
        self.daemon_proc = daemon
        self.bench_pid = bench_pid
        self.skip = skip
        self.stop_event = threading.Event()
        self.first = None
        self.last = None

    def snapshot(self) -> dict:
        kids = self.daemon_proc.redo_children()
        daemon_user, daemon_sys = read_cpu_split(self.daemon_proc.pid) or (0, 0)
        return {
            "t": time.monotonic(),
            "daemon": daemon_user + daemon_sys,
            "daemon_sys": daemon_sys,
            "redo": {k: read_cpu_ticks(k) or 0 for k in kids},
            "bench": read_cpu_ticks(self.bench_pid) or 0,
            "system": read_system_cpu(),
            "daemon_ctx": read_ctx_switches(self.daemon_proc.pid),
            "redo_ctx": {k: read_ctx_switches(k) for k in kids},
        }

    def run(self) -> None:
        time.sleep(self.skip)
        if self.stop_event.is_set():
            return
        self.first = self.snapshot()
        while not self.stop_event.wait(0.5):
            self.last = self.snapshot()

    def result(self) -> dict | None:
        if self.first is None or self.last is None:
            return None
        a, b = self.first, self.last
        secs = b["t"] - a["t"]
        pct = lambda ticks: round(100.0 * ticks / CLK_TCK / secs, 1)  # noqa: E731 - % of one CPU
        redo = sum(b["redo"].get(k, 0) - a["redo"].get(k, 0) for k in b["redo"] if k in a["redo"])
        sys_d = {k: b["system"][k] - a["system"][k] for k in a["system"]}
        total = sum(sys_d.values()) or 1
        redo_vol = sum(b["redo_ctx"][k][0] - a["redo_ctx"][k][0] for k in b["redo_ctx"] if k in a["redo_ctx"])
        busy = 100.0 * os.cpu_count() * (total - sys_d["idle"] - sys_d["iowait"]) / total
        ours = pct(b["daemon"] - a["daemon"]) + pct(redo) + pct(b["bench"] - a["bench"])
        return {
            "seconds": round(secs, 2),
            "daemon_cpu_pct": pct(b["daemon"] - a["daemon"]),
            # The part of it spent in the kernel (syscalls, the wake-ups they make, the
            # loopback's softirq work done on the sender's CPU).
            "daemon_sys_cpu_pct": pct(b["daemon_sys"] - a["daemon_sys"]),
            "redo_cpu_pct": pct(redo),
            "bench_cpu_pct": pct(b["bench"] - a["bench"]),
            "machine_pct": {k: round(100.0 * v / total, 1) for k, v in sys_d.items()},
            # CPU (% of one CPU) used by processes other than the daemon, its children and
            # pagebench: another workload on the machine makes the run suspect.
            "other_cpu_pct": round(busy - ours, 1),
            "daemon_vol_cs_per_s": round((b["daemon_ctx"][0] - a["daemon_ctx"][0]) / secs),
            "daemon_invol_cs_per_s": round((b["daemon_ctx"][1] - a["daemon_ctx"][1]) / secs),
            "redo_vol_cs_per_s": round(redo_vol / secs),
        }


def machine_busy_pct(seconds: float = 1.0) -> float:
    """Busy CPU of the whole machine over `seconds`, in % of one CPU."""
    a = read_system_cpu()
    time.sleep(seconds)
    b = read_system_cpu()
    d = {k: b[k] - a[k] for k in a}
    total = sum(d.values()) or 1
    return 100.0 * os.cpu_count() * (total - d["idle"] - d["iowait"]) / total


def wait_for_quiet_machine(limit: float, max_wait: float) -> float:
    """Waits (up to `max_wait` s) until the machine's busy CPU is below `limit` % of one CPU;
    returns the last reading. Other sessions' builds and benchmarks would skew the figures."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = machine_busy_pct()
        if busy < limit or time.monotonic() > deadline:
            return round(busy, 1)
        print(f"   machine busy ({busy:.0f}% of one CPU), waiting", file=sys.stderr)
        time.sleep(4)


def pagebench(bin_dir: Path, daemon: Daemon, args: list[str]) -> subprocess.Popen:
    command = [str(bin_dir / "pagebench"), *args, "--page-service", daemon.pg, "--http", daemon.http]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"pagebench failed ({proc.returncode}):\n{err}")
    return json.loads(out.strip().splitlines()[-1])


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def run_point(bin_dir, daemon, scenario, conns, depth, rate, duration, threads, quiet) -> dict:
    busy_before = wait_for_quiet_machine(*quiet)
    before = metrics(daemon.http)
    before_at = time.monotonic()
    load = ["--rate", str(rate)] if rate else ["--depth", str(depth)]
    proc = pagebench(bin_dir, daemon, ["get-page", *TENANT_ARGS, *scenario["shape"],
                                       "--lsn", scenario["lsn"], "--connections", str(conns),
                                       *load, "--duration", str(duration),
                                       "--threads", str(threads)])
    sampler = Sampler(daemon, proc.pid, skip=1.0)
    sampler.start()
    # Stop sampling before the tail (draining replies) to measure the steady state; halfway,
    # the gauges that hold a state rather than a count (whether CPU pressure holds the spin
    # budget back, the slots granted).
    time.sleep(max(duration / 2, 0))
    halfway = metrics(daemon.http)
    time.sleep(max(duration / 2 - 0.5, 0))
    sampler.stop_event.set()
    summary = finish(proc, duration + 120)
    sampler.join()
    after = metrics(daemon.http)
    elapsed = time.monotonic() - before_at
    requests = max(summary["requests"], 1)
    workers = after.get("pageserver_executor_workers", 0.0)
    redo_count = delta(after, before, "pageserver_wal_redo_seconds_count")
    cpu = sampler.result()

    def by_io(counter: str) -> dict[str, float]:
        """The run's increase of `pageserver_page_service_<counter>_total`, per writer."""
        return {io: delta(after, before, f'pageserver_page_service_{counter}_total{{io="{io}"}}')
                for io in ("epoll", "io_uring")}

    if cpu and summary["rps"]:
        # Daemon and redo children together, in microseconds of CPU per request served.
        cpu["cpu_us_per_request"] = round(1e4 * (cpu["daemon_cpu_pct"] + cpu["redo_cpu_pct"]) / summary["rps"], 1)
        cpu["daemon_us_per_request"] = round(1e4 * cpu["daemon_cpu_pct"] / summary["rps"], 1)
        cpu["daemon_sys_us_per_request"] = round(1e4 * cpu["daemon_sys_cpu_pct"] / summary["rps"], 1)
    return {
        "connections": conns,
        "depth": depth,
        "rate": rate,
        "machine_busy_before_pct": busy_before,
        "summary": summary,
        "cpu": cpu,
        "per_request": {
            "cache_hit_ratio": round(delta(after, before, "pageserver_page_cache_hits_total")
                                     / requests, 3),
            "redos": round(redo_count / requests, 3),
            "redo_us_mean": round(1e6 * delta(after, before, "pageserver_wal_redo_seconds_sum")
                                  / max(redo_count, 1), 1),
            "replies_per_write": round(delta(after, before, "pageserver_page_service_replies_per_write_sum")
                                       / max(delta(after, before, "pageserver_page_service_replies_per_write_count"), 1), 2),
            "fsyncs": delta(after, before, "pageserver_storage_fsyncs_total"),
            # Syscalls that sent replies (writev calls, and the io_uring writer's
            # io_uring_enter calls), per reply, and the share of replies sent through the ring.
            "send_syscalls": round(sum(by_io("send_syscalls").values()) / requests, 3),
            "io_uring_share": round(by_io("sends")["io_uring"] / max(sum(by_io("sends").values()), 1), 3),
            # Times an executor thread ran out of work and slept, per request; and how full the
            # executor was (busy time over the run's wall time and the workers). None where the
            # daemon has no executor metrics (builds before them, page-floor).
            "executor_parks": round(delta(after, before, "pageserver_executor_parks_total") / requests, 3)
                              if "pageserver_executor_parks_total" in after else None,
            "executor_busy_pct": round(100 * delta(after, before, "pageserver_executor_busy_seconds_total")
                                       / max(elapsed * workers, 1e-9), 1) if workers else None,
        },
        # Halfway through the run; None where the daemon has no such gauge. The state of the
        # last period in which a redo pool was active: the run's own where its requests are redos.
        "spin_budget": {
            "held_back": halfway.get("pageserver_wal_redo_spin_held_back"),
            "slots_granted": halfway.get("pageserver_wal_redo_spin_slots_granted"),
        },
    }


def run_strace(bin_dir, daemon, scenario, conns, depth, seconds=4.0) -> dict:
    """Syscalls per request of the daemon (all threads) and its redo child, from strace -c."""
    proc = pagebench(bin_dir, daemon, ["get-page", *TENANT_ARGS, *scenario["shape"],
                                       "--lsn", scenario["lsn"], "--connections", str(conns),
                                       "--depth", str(depth), "--duration", str(seconds + 3)])
    time.sleep(1.0)
    targets = [daemon.pid, *daemon.redo_children()]
    out_path = daemon.workdir / "strace.txt"
    before = metrics(daemon.http)
    strace = subprocess.Popen(["strace", "-c", "-f", "-o", str(out_path),
                               *sum((["-p", str(p)] for p in targets), [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(seconds)
    strace.send_signal(signal.SIGINT)
    strace.wait(timeout=30)
    after = metrics(daemon.http)
    finish(proc, 120)
    served = max(delta(after, before, "pageserver_page_service_requests_total{type=\"get_page\"}"), 1)
    calls = {}
    for line in out_path.read_text().splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(parts) >= 5 and parts[0].replace(".", "").isdigit() and parts[-1] != "total":
            try:
                calls[parts[-1]] = int(parts[3])
            except ValueError:
                pass
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:8]
    return {"connections": conns, "depth": depth, "requests_during_strace": served,
            "syscalls_per_request": {k: round(v / served, 2) for k, v in top},
            "total_per_request": round(sum(calls.values()) / served, 2)}


def parse_point(text: str) -> tuple[int, int, int | None]:
    """`CONNSxDEPTH` (closed loop) or `CONNSx@RATE` (open loop at RATE requests/s in total)."""
    shape, _, rate = text.partition("@")
    conns, _, depth = shape.partition("x")
    return int(conns), int(depth or 1), int(rate) if rate else None


def floor_ratio(r: dict, floors: dict) -> str:
    """The run's rps over page-floor's at the same point, or '' without a floor run."""
    floor = floors.get((r["scenario"], r["connections"], r["depth"], r.get("rate")))
    return f"{r['summary']['rps'] / floor:.2f}" if floor else ""


def point_label(conns: int, depth: int, rate: int | None) -> str:
    return f"{conns} x @{rate}/s" if rate else f"{conns} x {depth}"


def disturbed(run: dict, opts) -> bool:
    """Whether other processes or the hypervisor took a share of the machine during the run."""
    cpu = run["cpu"] or {}
    return (cpu.get("other_cpu_pct", 0) > opts.max_other_cpu
            or (cpu.get("machine_pct") or {}).get("steal", 0) > opts.max_steal)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    # SIGTERM and SIGINT (ignored when started in the background by a script) unwind through
    # the `finally` that stops the daemon.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", type=Path, default=Path("target/release"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--points", default="1x1,8x1,64x1,8x16",
                        help="comma separated: CONNECTIONSxDEPTH (closed loop), or CONNECTIONSx@RATE (open loop, "
                             "RATE requests/s in total)")
    parser.add_argument("--kinds", default="sync,async,auto",
                        help="daemon variants, comma separated: a walredo process kind, optionally with more "
                             "settings after colons, e.g. async:walredo_pool_max=1 (bin=DIR: that variant's daemon from DIR; "
                             "cpus=LIST: the daemon and its children pinned to those CPUs, e.g. cpus=0-1; env=NAME=VALUE: "
                             "a variable of the daemon's environment); "
                             "or `floor` (page-floor, the "
                             "loopback floor, with its flags after colons, e.g. floor:--threads=2)")
    parser.add_argument("--scenarios", default="cached,chain10",
                        help="comma separated: " + ", ".join(SCENARIOS)
                        + ", or chain<N>-redo / chain<N>-compacted / chain<N>-imaged (scenario_of)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per point; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="pagebench --threads")
    parser.add_argument("--strace", default="8x1", help="point traced with strace -c, or 'none'")
    parser.add_argument("--quiet-below", type=float, default=15.0,
                        help="before each run, wait until the machine's busy CPU is below this %% of one CPU")
    parser.add_argument("--quiet-max-wait", type=float, default=600.0)
    parser.add_argument("--max-other-cpu", type=float, default=10.0,
                        help="a run during which other processes used more (%% of one CPU) is redone")
    parser.add_argument("--max-steal", type=float, default=3.0,
                        help="a run with more hypervisor steal (%% of the machine) is redone")
    parser.add_argument("--keep", action="store_true", help="keep the daemons' work dirs (logs, strace output)")
    parser.add_argument("--relations", type=int, help="relations of every scenario's data set, in place of its own")
    parser.add_argument("--blocks", type=int, help="pages per relation of every scenario's data set, in place of its own")
    parser.add_argument("--tenants", type=int, default=1,
                        help="tenants with the scenario's data set each; a point's connections are per tenant")
    opts = parser.parse_args()
    if opts.tenants > 1:
        TENANT_ARGS.extend(["--tenants", str(opts.tenants)])

    points = [parse_point(p) for p in opts.points.split(",")]
    kinds = opts.kinds.split(",")
    results = []
    for scenario_name in opts.scenarios.split(","):
        scenario = scenario_of(scenario_name)
        for flag, value in (("--relations", opts.relations), ("--blocks", opts.blocks)):
            if value is not None:
                shape = list(scenario["shape"])
                shape[shape.index(flag) + 1] = str(value)
                scenario = {**scenario, "shape": shape}
        daemons: dict[str, Daemon] = {}
        try:
            # One daemon per kind, alive together; runs alternate between them (ABAB...), so that
            # a drift of the machine's speed hits both kinds alike.
            for kind in kinds:
                process_kind, *settings = kind.split(":")
                if process_kind == "floor":
                    # The loopback floor: settings are its flags (`floor:--threads=4`).
                    daemons[kind] = daemon = Daemon(opts.bin_dir, settings, floor_shape=scenario["shape"])
                    print(f"== {scenario_name} {kind}: page-floor pid {daemon.pid}", file=sys.stderr)
                    continue
                # `bin=DIR`: this variant's daemon (and redo child) from DIR, e.g. a build of another
                # commit to compare with side by side; pagebench is always --bin-dir's.
                daemon_dir = next((Path(x[4:]) for x in settings if x.startswith("bin=")), opts.bin_dir)
                # `cpus=LIST`: the daemon and its children pinned to those CPUs (core scaling).
                cpus = next((x[5:] for x in settings if x.startswith("cpus=")), None)
                # `env=NAME=VALUE`: a variable of the daemon's environment (e.g. TOKIO_WORKER_THREADS).
                env = dict(x[4:].split("=", 1) for x in settings if x.startswith("env="))
                settings = [x for x in settings if not x.startswith(("bin=", "cpus=", "env="))]
                daemons[kind] = daemon = Daemon(daemon_dir, [f"walredo_process_kind={process_kind}", *settings,
                                                             *scenario["config"]], cpus=cpus, env=env)
                print(f"== {scenario_name} {kind}: daemon pid {daemon.pid} in {daemon.workdir}", file=sys.stderr)
                ingest = finish(pagebench(opts.bin_dir, daemon, ["ingest", *TENANT_ARGS, *scenario["shape"]]),
                                600)
                print(f"   ingest {ingest}", file=sys.stderr)
                if scenario.get("compact"):
                    url = f"http://{daemon.http}/v1/tenant/bench/compact"
                    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=600) as r:
                        print(f"   compacted: {json.loads(r.read())['pass']}", file=sys.stderr)
                if scenario["warmup"]:
                    finish(pagebench(opts.bin_dir, daemon, ["get-page", *TENANT_ARGS, *scenario["shape"],
                                                            "--lsn", scenario["lsn"], "--connections", "8",
                                                            "--duration", str(scenario["warmup"])]), 120)
            for conns, depth, rate in points:
                runs = {kind: [] for kind in kinds}
                discarded = {kind: 0 for kind in kinds}
                last = {}
                for _ in range(opts.repeat * 2):
                    for kind in kinds:
                        if len(runs[kind]) >= opts.repeat or discarded[kind] >= opts.repeat:
                            continue
                        run = run_point(opts.bin_dir, daemons[kind], scenario, conns, depth, rate, opts.duration,
                                        opts.threads, (opts.quiet_below, opts.quiet_max_wait))
                        last[kind] = run
                        if disturbed(run, opts):
                            discarded[kind] += 1
                            print(f"   {kind} {point_label(conns, depth, rate)}: run disturbed ({run['cpu']}), redone", file=sys.stderr)
                            continue
                        runs[kind].append(run)
                for kind in kinds:
                    kind_runs = sorted(runs[kind] or [last[kind]], key=lambda run: run["summary"]["rps"])
                    # The run with the median throughput stands for the point; the others give its spread.
                    r = dict(kind_runs[len(kind_runs) // 2])
                    r.update(scenario=scenario_name, kind=kind, discarded_runs=discarded[kind],
                             rps_runs=[run["summary"]["rps"] for run in kind_runs],
                             p50_runs=[run["summary"]["latency_us"]["p50"] for run in kind_runs],
                             other_cpu_runs=[(run["cpu"] or {}).get("other_cpu_pct") for run in kind_runs],
                             daemon_us_runs=[(run["cpu"] or {}).get("daemon_us_per_request") for run in kind_runs],
                             daemon_sys_us_runs=[(run["cpu"] or {}).get("daemon_sys_us_per_request")
                                                 for run in kind_runs],
                             held_back_runs=[run["spin_budget"]["held_back"] for run in kind_runs])
                    results.append(r)
                    s = r["summary"]
                    print(f"   {kind:<5} {point_label(conns, depth, rate):>9} rps {s['rps']:>9} p50 {s['latency_us']['p50']:>6} "
                          f"p99 {s['latency_us']['p99']:>6} p999 {s['latency_us']['p999']:>6} "
                          f"errors {s['errors']} runs {r['rps_runs']} cpu {r['cpu']} per_request {r['per_request']} "
                          f"spin budget held back {r['held_back_runs']}",
                          file=sys.stderr)
                opts.out.write_text(json.dumps(results, indent=1))
            if opts.strace != "none":
                conns, depth = (int(x) for x in opts.strace.split("x"))
                for kind in kinds:
                    st = run_strace(opts.bin_dir, daemons[kind], scenario, conns, depth)
                    st.update(scenario=scenario_name, kind=kind, strace=True)
                    results.append(st)
                    print(f"   strace {st}", file=sys.stderr)
        finally:
            for daemon in daemons.values():
                daemon.stop(keep=opts.keep)
        opts.out.write_text(json.dumps(results, indent=1))
    opts.out.write_text(json.dumps(results, indent=1))

    # The loopback floor's rps at each point, for the "/ floor" column.
    floors = {(r["scenario"], r["connections"], r["depth"], r.get("rate")): r["summary"]["rps"]
              for r in results if r["kind"].split(":")[0] == "floor" and not r.get("strace")}
    results.sort(key=lambda r: (r["scenario"], r["kind"], r.get("strace", False)))
    print("| scenario | kind | conns x depth | rps (median) | rps (runs) | p50 us | p99 us | p99.9 us | errors "
          "| daemon CPU % | redo CPU % | CPU us / request | daemon CPU us / request | daemon CPU us / request, median of runs "
          "| of it in the kernel, median of runs | executor parks / request | pagebench CPU % | idle % | other CPU % | / floor |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r.get("strace"):
            continue
        s, c = r["summary"], r["cpu"] or {}
        lat = s["latency_us"]
        runs = "/".join(f"{x / 1000:.1f}k" for x in r.get("rps_runs", [s["rps"]]))
        print(f"| {r['scenario']} | {r['kind']} | {point_label(r['connections'], r['depth'], r.get('rate'))} | {s['rps']:.0f} | {runs} | {lat['p50']} "
              f"| {lat['p99']} | {lat['p999']} | {s['errors']} | {c.get('daemon_cpu_pct')} | {c.get('redo_cpu_pct')} | {c.get('cpu_us_per_request')} "
              f"| {c.get('daemon_us_per_request')} | {median_or_none(r.get('daemon_us_runs'))} "
              f"| {median_or_none(r.get('daemon_sys_us_runs'))} "
              f"| {(r.get('per_request') or {}).get('executor_parks')} "
              f"| {c.get('bench_cpu_pct')} | {(c.get('machine_pct') or {}).get('idle')} | {c.get('other_cpu_pct')} "
              f"| {floor_ratio(r, floors)} |")
    return 0


def median_or_none(values: list | None) -> float | None:
    """The median of the values that are there (a run without CPU figures has none), or None."""
    values = [v for v in values or [] if v is not None]
    return round(statistics.median(values), 3) if values else None


if __name__ == "__main__":
    sys.exit(main())
