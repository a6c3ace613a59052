//! Counters and histograms that many threads update at once without sharing a cache line: one
//! shard of counts per thread (threads beyond the shard count share), summed at each scrape.
//! A daemon-wide series has a shard per CPU (at most 64); a tenant's, at most
//! [`TENANT_SHARDS`], so that a daemon of many tenants on many cores does not spend megabytes
//! on them (a tenant's sharded counts take 4 KiB: its GetPage and redo time histograms, its
//! GetPage count, its redo load).
//!
//! A prometheus `Histogram` is one set of atomics that every observing thread writes (its count,
//! its sum by compare-and-swap, a bucket), and an `IntCounter` one atomic: where the threads
//! serving GetPage each update a few per request, the cache lines bounce between cores. Two
//! threads observing one histogram and incrementing one counter as fast as they can took about
//! 250 ns per pair on the 2-vCPU machine, against 16 ns with one of each per thread
//! (docs/performance.md, "Metrics in shards"). Here each thread updates only its own shard,
//! with plain atomic adds that no other core touches; a scrape reads every shard. The exported
//! series are the same as the prometheus types' (name, help, labels, buckets), registered as
//! collectors.
//!
//! A scrape taken while observations land may count one in a bucket and not yet in the sum;
//! the count is always the sum of the buckets, so the `+Inf` bucket equals it.
//!
//! [`ShardedSums`] are the same shards without a series, for counts that the daemon reads
//! itself. [`ReadGauge`] is the degenerate case: a gauge whose value is an atomic its owner keeps
//! anyway (the redo memory budget's bytes in use), read at each scrape, so that an update is
//! not a second write of a shared line.
//!
//! **Invariant:** nothing here blocks or allocates on the update path; a shard is a whole number
//! of 128-byte lines of its own.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use prometheus::core::{Collector, Desc, Describer};
use prometheus::proto;
use prometheus::{HistogramOpts, Opts};

/// 128 bytes of counts: two cache lines, so that the adjacent-line prefetch of one shard does
/// not take its neighbour's line.
#[repr(align(128))]
struct Line([AtomicU64; SLOTS_PER_LINE]);

const SLOTS_PER_LINE: usize = 16;

/// Shards per metric: the machine's CPUs as a power of two, at most 64.
fn shard_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(64).next_power_of_two()
    })
}

/// This thread's shard: threads take shards in the order they first update a metric.
fn shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: Cell<Option<usize>> = const { Cell::new(None) };
    }
    SHARD.with(|s| match s.get() {
        Some(shard) => shard,
        None => {
            let shard = NEXT.fetch_add(1, Ordering::Relaxed) % shard_count();
            s.set(Some(shard));
            shard
        }
    })
}

/// Shards of a series kept per tenant: at most this many, so that a tenant's few series take
/// a few KiB however many CPUs the machine has (threads then share a shard two or more to one).
pub const TENANT_SHARDS: usize = 8;

/// `slots` counts per shard, each shard on lines of its own.
struct Slots {
    lines: Box<[Line]>,
    lines_per_shard: usize,
    /// A power of two, at most [`shard_count`].
    shards: usize,
}

impl Slots {
    /// At most `max_shards` shards (rounded down to a power of two).
    fn new(slots: usize, max_shards: usize) -> Slots {
        // The largest power of two at most `max_shards` (and at least 1).
        let floor_pow2 = 1 << (usize::BITS - 1 - max_shards.max(1).leading_zeros());
        let shards = shard_count().min(floor_pow2);
        let lines_per_shard = slots.div_ceil(SLOTS_PER_LINE).max(1);
        let lines =
            (0..lines_per_shard * shards).map(|_| Line(std::array::from_fn(|_| AtomicU64::new(0)))).collect();
        Slots { lines, lines_per_shard, shards }
    }

    /// Slot `slot` of this thread's shard.
    fn mine(&self, slot: usize) -> &AtomicU64 {
        self.at(shard() & (self.shards - 1), slot)
    }

    fn at(&self, shard: usize, slot: usize) -> &AtomicU64 {
        &self.lines[shard * self.lines_per_shard + slot / SLOTS_PER_LINE].0[slot % SLOTS_PER_LINE]
    }

    /// Slot `slot` summed over the shards.
    fn sum(&self, slot: usize) -> u64 {
        (0..self.shards).map(|s| self.at(s, slot).load(Ordering::Relaxed)).fold(0, u64::wrapping_add)
    }
}

/// A counter (`IntCounter`'s series) updated in shards.
#[derive(Clone)]
pub struct ShardedCounter(Arc<CounterCore>);

struct CounterCore {
    desc: Desc,
    slots: Slots,
}

impl ShardedCounter {
    pub fn new(opts: Opts) -> prometheus::Result<ShardedCounter> {
        ShardedCounter::with_shards(opts, usize::MAX)
    }

    /// With at most `max_shards` shards (e.g. [`TENANT_SHARDS`]).
    pub fn with_shards(opts: Opts, max_shards: usize) -> prometheus::Result<ShardedCounter> {
        let slots = Slots::new(1, max_shards);
        Ok(ShardedCounter(Arc::new(CounterCore { desc: opts.describe()?, slots })))
    }

    pub fn inc(&self) {
        self.inc_by(1);
    }

    pub fn inc_by(&self, v: u64) {
        self.0.slots.mine(0).fetch_add(v, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.slots.sum(0)
    }
}

impl Collector for ShardedCounter {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.0.desc]
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        let mut counter = proto::Counter::default();
        counter.set_value(self.get() as f64);
        let mut m = proto::Metric::from_label(self.0.desc.const_label_pairs.clone());
        m.set_counter(counter);
        vec![family(&self.0.desc, proto::MetricType::COUNTER, m)]
    }
}

/// A histogram (`Histogram`'s series) updated in shards. A shard's slots: the sum (an `f64`'s
/// bits), then one count per bucket, the last one `+Inf`.
#[derive(Clone)]
pub struct ShardedHistogram(Arc<HistogramCore>);

struct HistogramCore {
    desc: Desc,
    /// The finite upper bounds, increasing.
    upper: Vec<f64>,
    slots: Slots,
}

impl ShardedHistogram {
    /// Refuses what `Histogram::with_opts` refuses (no buckets, or buckets not increasing); a
    /// last bucket of `+Inf` is implied and dropped.
    pub fn new(opts: HistogramOpts) -> prometheus::Result<ShardedHistogram> {
        ShardedHistogram::with_shards(opts, usize::MAX)
    }

    /// With at most `max_shards` shards (e.g. [`TENANT_SHARDS`]).
    pub fn with_shards(opts: HistogramOpts, max_shards: usize) -> prometheus::Result<ShardedHistogram> {
        let desc = opts.describe()?;
        let mut upper = opts.buckets;
        if upper.last().is_some_and(|b| b.is_infinite() && b.is_sign_positive()) {
            upper.pop();
        }
        if upper.is_empty() || upper.windows(2).any(|w| w[0] >= w[1]) {
            return Err(prometheus::Error::Msg(format!(
                "{}: histogram buckets must be given, in increasing order",
                desc.fq_name
            )));
        }
        let slots = Slots::new(upper.len() + 2, max_shards);
        Ok(ShardedHistogram(Arc::new(HistogramCore { desc, upper, slots })))
    }

    pub fn observe(&self, v: f64) {
        let core = &*self.0;
        // The first bucket whose bound is at or above `v` (`+Inf` past the last, and for NaN),
        // found as prometheus does, from the smallest: a run of requests lands in the same few
        // buckets, where a scan's branches are predicted and a binary search's are not.
        let bucket = core.upper.iter().position(|&b| v <= b).unwrap_or(core.upper.len());
        core.slots.mine(1 + bucket).fetch_add(1, Ordering::Relaxed);
        let sum = core.slots.mine(0);
        // This shard's own line: the exchange succeeds at once unless threads share the shard.
        let _ = sum.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
            Some((f64::from_bits(bits) + v).to_bits())
        });
    }

    /// Observations so far.
    pub fn get_sample_count(&self) -> u64 {
        (0..=self.0.upper.len()).map(|b| self.0.slots.sum(1 + b)).sum()
    }

    /// Sum of the observations so far.
    pub fn get_sample_sum(&self) -> f64 {
        let slots = &self.0.slots;
        (0..slots.shards).map(|s| f64::from_bits(slots.at(s, 0).load(Ordering::Relaxed))).sum()
    }
}

impl Collector for ShardedHistogram {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.0.desc]
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        let core = &*self.0;
        let mut cumulative = 0;
        let mut buckets = Vec::with_capacity(core.upper.len());
        for (i, &upper) in core.upper.iter().enumerate() {
            cumulative += core.slots.sum(1 + i);
            let mut b = proto::Bucket::default();
            b.set_cumulative_count(cumulative);
            b.set_upper_bound(upper);
            buckets.push(b);
        }
        let mut h = proto::Histogram::default();
        h.set_bucket(buckets);
        h.set_sample_count(cumulative + core.slots.sum(1 + core.upper.len()));
        h.set_sample_sum(self.get_sample_sum());
        let mut m = proto::Metric::from_label(core.desc.const_label_pairs.clone());
        m.set_histogram(h);
        vec![family(&core.desc, proto::MetricType::HISTOGRAM, m)]
    }
}

impl std::fmt::Debug for ShardedCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShardedCounter({} = {})", self.0.desc.fq_name, self.get())
    }
}

impl std::fmt::Debug for ShardedHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShardedHistogram({}: {} observed)", self.0.desc.fq_name, self.get_sample_count())
    }
}

/// Sums updated in shards and exported nowhere: counts a request path bumps and a periodic
/// reader sums (e.g. a tenant's redo load, which its pool's controller reads every 100 ms).
pub struct ShardedSums(Slots);

impl ShardedSums {
    /// `sums` sums, in at most `max_shards` shards.
    pub fn new(sums: usize, max_shards: usize) -> ShardedSums {
        ShardedSums(Slots::new(sums, max_shards))
    }

    /// Adds `v` to sum `i` (wrapping).
    pub fn add(&self, i: usize, v: u64) {
        self.0.mine(i).fetch_add(v, Ordering::Relaxed);
    }

    /// Sum `i` over the shards: never less than a sum read before it.
    pub fn sum(&self, i: usize) -> u64 {
        self.0.sum(i)
    }
}

impl std::fmt::Debug for ShardedSums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedSums").field("shards", &self.0.shards).finish()
    }
}

/// A gauge (`IntGauge`'s series) whose value is an atomic kept by its owner, read at each scrape.
#[derive(Clone)]
pub struct ReadGauge {
    desc: Arc<Desc>,
    value: Arc<AtomicU64>,
}

impl ReadGauge {
    /// A gauge of `value`, which its owner updates.
    pub fn new(opts: Opts, value: Arc<AtomicU64>) -> prometheus::Result<ReadGauge> {
        Ok(ReadGauge { desc: Arc::new(opts.describe()?), value })
    }
}

impl Collector for ReadGauge {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        let mut gauge = proto::Gauge::default();
        gauge.set_value(self.value.load(Ordering::Relaxed) as f64);
        let mut m = proto::Metric::from_label(self.desc.const_label_pairs.clone());
        m.set_gauge(gauge);
        vec![family(&self.desc, proto::MetricType::GAUGE, m)]
    }
}

fn family(desc: &Desc, kind: proto::MetricType, metric: proto::Metric) -> proto::MetricFamily {
    let mut f = proto::MetricFamily::default();
    f.set_name(desc.fq_name.clone());
    f.set_help(desc.help.clone());
    f.set_field_type(kind);
    f.set_metric(vec![metric]);
    f
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use prometheus::{Histogram, IntCounter, Registry};

    fn text(registry: &Registry) -> String {
        prometheus::TextEncoder::new().encode_to_string(&registry.gather()).unwrap()
    }

    /// Observed from many threads at once, the sharded types export exactly what the
    /// prometheus types given the same observations export.
    #[test]
    fn many_threads_export_what_the_prometheus_types_export() {
        let opts = || {
            HistogramOpts::new("h_seconds", "help of h")
                .const_label("tenant_id", "t1")
                .buckets(vec![0.5, 1.0, 4.0])
        };
        let (sharded, plain) = (Registry::new(), Registry::new());
        let h = ShardedHistogram::new(opts()).unwrap();
        let c = ShardedCounter::new(Opts::new("c_total", "help of c").const_label("io", "epoll")).unwrap();
        sharded.register(Box::new(h.clone())).unwrap();
        sharded.register(Box::new(c.clone())).unwrap();
        let ph = Histogram::with_opts(opts()).unwrap();
        let pc = IntCounter::with_opts(Opts::new("c_total", "help of c").const_label("io", "epoll")).unwrap();
        plain.register(Box::new(ph.clone())).unwrap();
        plain.register(Box::new(pc.clone())).unwrap();
        // Values on and between the bounds, and past the last one.
        let values = [0.25, 0.5, 0.75, 1.0, 2.0, 4.0, 8.0];
        std::thread::scope(|s| {
            for t in 0..8 {
                let (h, c) = (h.clone(), c.clone());
                s.spawn(move || {
                    for i in 0..1000 {
                        h.observe(values[(i + t) % values.len()]);
                        c.inc_by(2);
                    }
                });
            }
        });
        for t in 0..8 {
            for i in 0..1000 {
                ph.observe(values[(i + t) % values.len()]);
                pc.inc_by(2);
            }
        }
        assert_eq!(text(&sharded), text(&plain));
        assert_eq!((h.get_sample_count(), c.get()), (8000, 16000));
        assert_eq!(h.get_sample_sum(), ph.get_sample_sum());
    }

    /// Sums added to from more threads than shards lose nothing, and each sum is its own.
    #[test]
    fn sums_from_many_threads_lose_nothing() {
        let sums = ShardedSums::new(3, 2);
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let sums = &sums;
                s.spawn(move || {
                    for _ in 0..1000 {
                        sums.add(0, 1);
                        sums.add(2, t);
                    }
                });
            }
        });
        assert_eq!((sums.sum(0), sums.sum(1), sums.sum(2)), (8000, 0, 28_000));
    }

    /// A read gauge exports what an `IntGauge` set to its atomic's value exports, as of the
    /// scrape.
    #[test]
    fn a_read_gauge_exports_its_atomic_as_an_int_gauge_would() {
        let (read, plain) = (Registry::new(), Registry::new());
        let value = Arc::new(AtomicU64::new(0));
        read.register(Box::new(
            ReadGauge::new(Opts::new("used_bytes", "help of used"), Arc::clone(&value)).unwrap(),
        ))
        .unwrap();
        let gauge = prometheus::IntGauge::new("used_bytes", "help of used").unwrap();
        plain.register(Box::new(gauge.clone())).unwrap();
        for v in [0, 12288, 1 << 40] {
            value.store(v, Ordering::Relaxed);
            gauge.set(v as i64);
            assert_eq!(text(&read), text(&plain), "at {v}");
        }
        assert!(text(&read).contains("used_bytes 1099511627776"), "{}", text(&read));
    }

    /// Two counters of one name that differ in a constant label are one family in a scrape.
    #[test]
    fn counters_of_one_name_with_different_labels_are_one_family() {
        let registry = Registry::new();
        for io in ["epoll", "io_uring"] {
            let c = ShardedCounter::new(Opts::new("sends_total", "sends").const_label("io", io)).unwrap();
            c.inc();
            registry.register(Box::new(c)).unwrap();
        }
        let text = text(&registry);
        assert_eq!(text.matches("# TYPE sends_total counter").count(), 1, "{text}");
        assert!(
            text.contains("sends_total{io=\"epoll\"} 1") && text.contains("sends_total{io=\"io_uring\"} 1")
        );
    }

    /// A series with fewer shards than threads still counts every update (threads share).
    #[test]
    fn fewer_shards_than_threads_lose_nothing() {
        for max in [1, 3, TENANT_SHARDS] {
            let slots = Slots::new(1, max);
            assert!(slots.shards.is_power_of_two() && slots.shards <= max && slots.shards <= shard_count());
            let c = ShardedCounter::with_shards(Opts::new("c", "c"), max).unwrap();
            let h =
                ShardedHistogram::with_shards(HistogramOpts::new("h", "h").buckets(vec![1.0]), max).unwrap();
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| {
                        for _ in 0..1000 {
                            c.inc();
                            h.observe(0.5);
                        }
                    });
                }
            });
            assert_eq!((c.get(), h.get_sample_count(), h.get_sample_sum()), (4000, 4000, 2000.0), "{max}");
        }
    }

    #[test]
    fn buckets_out_of_order_are_refused() {
        assert!(ShardedHistogram::new(HistogramOpts::new("h", "h").buckets(vec![1.0, 1.0])).is_err());
        assert!(ShardedHistogram::new(HistogramOpts::new("h", "h").buckets(vec![])).is_err());
        let h =
            ShardedHistogram::new(HistogramOpts::new("h", "h").buckets(vec![1.0, f64::INFINITY])).unwrap();
        h.observe(3.0);
        assert_eq!(h.get_sample_count(), 1);
    }
}
