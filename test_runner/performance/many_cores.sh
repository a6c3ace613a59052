#!/usr/bin/env bash
# Issue 23's many-core matrix in one command: what docs/performance.md, "Issue 23 on 2 vCPUs and
# 16 cores, side by side", measured, for a lent 16-core machine (no Rust there: the release
# binaries are carried to it, staged as below) or this one. Every step writes its JSON and log
# under OUT as it goes and is cut off at its own limit (SIGINT: measure.py stops its daemons),
# so that a device call that runs out of time still brings back what it measured.
#
#   many_cores.sh OUT NEW BASE [BENCH]
#
# - OUT: a directory for the results (created).
# - NEW: release binaries of the build to measure (pageserver, walredo-proc, pagebench,
#   page-floor; echo-child too for BENCH).
# - BASE: pageserver and walredo-proc of the baseline build (a11fcca for issue 23's part 1).
# - BENCH (optional): bench_walredo's release bench binary, in a copy of the target tree's
#   layout: BENCH's parent's parent is a profile directory whose sibling `walredo-testing` holds
#   `release/walredo-proc`, built with its `testing` feature. The echo child is copied to the
#   absolute path compiled into BENCH.
#
# Steps:
# 1. Cached pages: the floor and the three writers (pagebench --threads CACHED_THREADS).
# 2. Redo GetPage (chain10-redo): BASE against NEW, kinds auto and async (--threads REDO_THREADS).
# 3. 64 x 8 redo with the daemons pinned to 2 cores, and NEW with 8 executor threads. With
#    step 2 this is where the executor's parks per request (measure.py's table; NEW only, the
#    baseline has no executor metrics) say whether the runtime's sleeping and waking is what
#    grows with the cores. Each run's `spin_budget` (measure.py's JSON, halfway through the
#    run) says whether CPU pressure held the spin budget back there.
# 4. The spin budget's own case: 16 tenants of one connection each (small-chain10 --tenants
#    16, 1 x 1 per tenant), BASE against NEW, `auto`; with each run's spin budget state.
# 5. bench_walredo: auto/short/1 against the floors (if BENCH is given).
# 6. bench_shared_lines and bench_metrics, if their binaries lie next to BENCH (named so): work
#    on shared state by 1, 2 and as many threads as the machine has CPUs.
#
# Settings (environment): SECONDS_PER_RUN (3), REPEAT (2), CACHED_THREADS (8), REDO_THREADS
# (4), CACHED_POINTS (64x1,256x1,512x1,64x16,256x16), REDO_POINTS (1x1,8x1,64x8), and each
# step's limit in seconds: LIMIT_CACHED (200), LIMIT_REDO (115), LIMIT_CORES (45),
# LIMIT_TENANTS (40), LIMIT_BENCH (40), LIMIT_LINES (120: two thirds for bench_shared_lines, a
# third for bench_metrics). The limits add up to 9.5 minutes, within one device call (on the
# 16-core machine of 2026-11-27 the steps took 7.5). On a machine used by nobody else the
# quiet checks of measure.py are loosened (QUIET=loose, the default); QUIET=strict keeps them.
#
# Staging for the device (here, from the repository's root; `.bench/` listed in
# .git/info/exclude, then named in the call's `carry`):
#
#   cargo build --release --bins && cargo build --release -p benches --bins
#   cargo bench -p benches --bench bench_walredo --no-run     # prints the bench binary's path
#   mkdir -p .bench/new .bench/base .bench/t/release/deps .bench/t/walredo-testing/release
#   cp target/release/{pageserver,walredo-proc,pagebench,page-floor,echo-child} .bench/new/
#   cp <baseline build>/{pageserver,walredo-proc} .bench/base/
#   cp <bench binary> .bench/t/release/deps/bench_walredo
#   cargo bench -p benches --bench bench_shared_lines --bench bench_metrics --no-run
#   cp <their binaries> .bench/t/release/deps/bench_shared_lines, .../bench_metrics
#   cp target/walredo-testing/release/walredo-proc .bench/t/walredo-testing/release/
#   strip .bench/new/* .bench/base/* .bench/t/release/deps/* .bench/t/walredo-testing/release/*
#
# and on the device: test_runner/performance/many_cores.sh "$OUT" .bench/new .bench/base
# .bench/t/release/deps/bench_walredo

set -uo pipefail

if [ $# -lt 3 ] || [ $# -gt 4 ]; then
    sed -n '2,17p' "$0" >&2
    exit 2
fi
OUT=$1 NEW=$2 BASE=$3 BENCH=${4:-}
for f in "$NEW"/{pageserver,walredo-proc,pagebench,page-floor} "$BASE"/{pageserver,walredo-proc}; do
    [ -x "$f" ] || { echo "many_cores.sh: $f is not an executable" >&2; exit 2; }
done
mkdir -p "$OUT" || exit 2
here=$(dirname "$0")
export PYTHONUNBUFFERED=1

measure=(python3 "$here/measure.py" --bin-dir "$NEW" --strace none
         --duration "${SECONDS_PER_RUN:-3}" --repeat "${REPEAT:-2}")
case ${QUIET:-loose} in
    # Nothing else runs there, and the loopback's softirq work counts as other CPU.
    loose) measure+=(--quiet-below 400 --quiet-max-wait 5 --max-other-cpu 100000 --max-steal 100) ;;
    strict) ;;
    *) echo "many_cores.sh: QUIET is loose or strict, not $QUIET" >&2; exit 2 ;;
esac

log() { echo "### $(date -u +%FT%TZ) $*" >> "$OUT/log.txt"; }
step() { # step NAME LIMIT COMMAND...: the command's output goes to the log
    local name=$1 limit=$2
    shift 2
    log "$name"
    timeout -s INT "$limit" "$@" >> "$OUT/log.txt" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || log "$name ended with status $rc"
}

# The machine heads the log (a device call brings back at most 8 files: the log, four JSON
# files and the three bench outputs).
{
    date -u
    uname -r
    nproc
    grep -m1 'model name' /proc/cpuinfo
    cat /sys/devices/system/clocksource/clocksource0/current_clocksource
} > "$OUT/log.txt" 2>&1

step cached "${LIMIT_CACHED:-200}" "${measure[@]}" --scenarios cached --threads "${CACHED_THREADS:-8}" \
    --kinds "floor,auto:page_service_io=epoll,auto:page_service_io=io_uring,auto" \
    --points "${CACHED_POINTS:-64x1,256x1,512x1,64x16,256x16}" --out "$OUT/cached.json"
step redo "${LIMIT_REDO:-115}" "${measure[@]}" --scenarios chain10-redo --threads "${REDO_THREADS:-4}" \
    --kinds "auto:bin=$BASE,auto,async:bin=$BASE,async" --points "${REDO_POINTS:-1x1,8x1,64x8}" \
    --out "$OUT/redo.json"
step cores "${LIMIT_CORES:-45}" "${measure[@]}" --scenarios chain10-redo --threads "${REDO_THREADS:-4}" \
    --kinds "auto:cpus=0-1:bin=$BASE,auto:cpus=0-1,auto:env=TOKIO_WORKER_THREADS=8" --points 64x8 \
    --out "$OUT/cores.json"

step tenants "${LIMIT_TENANTS:-40}" "${measure[@]}" --scenarios small-chain10 --tenants 16 \
    --threads "${REDO_THREADS:-4}" --kinds "auto:bin=$BASE,auto" --points 1x1 --out "$OUT/tenants.json"
if [ -n "$BENCH" ]; then
    echo_child=$(grep -ao '/[A-Za-z0-9_./+-]*/target/release/echo-child' "$BENCH" | head -1)
    if [ -z "$echo_child" ] || ! [ -x "$NEW/echo-child" ]; then
        log "bench skipped: no echo-child path in $BENCH, or no $NEW/echo-child"
    elif mkdir -p "$(dirname "$echo_child")" && cp "$NEW/echo-child" "$echo_child"; then
        # CARGO=/bin/true: the bench takes the prebuilt walredo-testing child instead of building it.
        log bench
        CARGO=/bin/true timeout -s INT "${LIMIT_BENCH:-40}" "$BENCH" --bench --measurement-time 3 \
            --warm-up-time 1 '^floor/echo/1$|^auto/short/1$|^floor/echo-(same|cross)-cpu/1$' \
            > "$OUT/bench.txt" 2>&1 || log "bench ended with status $?"
    else
        log "bench skipped: cannot place the echo child at $echo_child"
    fi
fi
if [ -n "$BENCH" ]; then
    lines=${LIMIT_LINES:-120}
    for b in bench_shared_lines:$(( lines * 2 / 3 )) bench_metrics:$(( lines / 3 )); do
        limit=${b#*:} b=${b%%:*} bin="$(dirname "$BENCH")/$b"
        if [ -x "$bin" ]; then
            log "$b"
            timeout -s INT "$limit" "$bin" --bench --measurement-time 2 --warm-up-time 1 \
                > "$OUT/$b.txt" 2>&1 || log "$b ended with status $?"
        else
            log "$b skipped: no $bin"
        fi
    done
fi
log done
grep -h '^| ' "$OUT/log.txt"
