//! Per-tenant instruments: the series a tenant and its redo manager keep of their own requests
//! (labelled `tenant_id`, registered nowhere; `tenant_series` exports those of the busiest
//! tenants at each scrape).
//!
//! A module of the bottom layer, so that the redo manager, the tenant and the collector above
//! them all reach it without importing each other. Its child [`sharded`] holds the counters
//! and histograms that the threads serving GetPage update per request. [`Instruments`] serves
//! the collectors that set their instruments at each scrape (process and executor figures).

pub mod sharded;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{exponential_buckets, HistogramOpts, IntCounter, IntGauge, Opts};

use sharded::ShardedHistogram;

/// What a tenant's GetPage requests and redo requests cost; coarser buckets than the
/// daemon-wide histograms (14 against 22), since these are per tenant.
fn buckets() -> Vec<f64> {
    // 25 us to ~205 ms.
    exponential_buckets(25e-6, 2.0, 14).expect("constant buckets are valid")
}

/// A histogram of one tenant, labelled `tenant_id`, registered nowhere; in shards (at most
/// [`sharded::TENANT_SHARDS`]), since one busy tenant's requests are served by every executor
/// thread.
fn histogram(name: &str, help: &str, tenant_id: &str) -> ShardedHistogram {
    ShardedHistogram::with_shards(
        HistogramOpts::new(name, help).const_label("tenant_id", tenant_id).buckets(buckets()),
        sharded::TENANT_SHARDS,
    )
    .expect("a constant name and any label value are valid")
}

/// A counter of one tenant, labelled `tenant_id`, registered nowhere.
fn counter(name: &str, help: &str, tenant_id: &str) -> IntCounter {
    IntCounter::with_opts(Opts::new(name, help).const_label("tenant_id", tenant_id))
        .expect("a constant name and any label value are valid")
}

/// A gauge of one tenant, labelled `tenant_id`, registered nowhere.
pub(crate) fn gauge(name: &str, help: &str, tenant_id: &str, value: i64) -> IntGauge {
    let gauge = IntGauge::with_opts(Opts::new(name, help).const_label("tenant_id", tenant_id))
        .expect("a constant name and any label value are valid");
    gauge.set(value);
    gauge
}

/// The series names and help texts (one place, for the tenants' instruments and the descs).
pub mod names {
    pub const GET_PAGE_SECONDS: (&str, &str) =
        ("pageserver_tenant_get_page_seconds", "Time to serve a GetPage request of the tenant, by tenant");
    pub const GET_PAGE_ERRORS: (&str, &str) =
        ("pageserver_tenant_get_page_errors_total", "GetPage requests of the tenant that failed, by tenant");
    pub const REDO_SECONDS: (&str, &str) = (
        "pageserver_tenant_wal_redo_seconds",
        "Time of a successful WAL redo request of the tenant, by tenant",
    );
    pub const REDO_ERRORS: (&str, &str) =
        ("pageserver_tenant_wal_redo_errors_total", "WAL redo requests of the tenant that failed, by tenant");
    pub const REDO_CHILDREN: (&str, &str) =
        ("pageserver_tenant_wal_redo_children", "Redo children of the tenant's pool, by tenant");
    pub const REDO_SPINNING: (&str, &str) = (
        "pageserver_tenant_wal_redo_spinning_children",
        "Redo children of the tenant that busy-poll between requests, by tenant",
    );
}

/// A tenant's series of one kind of request: the requests' time and their failures. A tenant
/// has one for GetPage; its redo manager has one for redo (whose time is of successful requests
/// only, as the daemon-wide `pageserver_wal_redo_seconds`).
pub struct RequestSeries {
    pub seconds: ShardedHistogram,
    pub errors: IntCounter,
}

impl RequestSeries {
    pub fn get_page(tenant_id: &str) -> RequestSeries {
        RequestSeries::new(tenant_id, names::GET_PAGE_SECONDS, names::GET_PAGE_ERRORS)
    }

    pub fn redo(tenant_id: &str) -> RequestSeries {
        RequestSeries::new(tenant_id, names::REDO_SECONDS, names::REDO_ERRORS)
    }

    fn new(
        tenant_id: &str,
        (name, help): (&str, &str),
        (errors_name, errors_help): (&str, &str),
    ) -> RequestSeries {
        RequestSeries {
            seconds: histogram(name, help, tenant_id),
            errors: counter(errors_name, errors_help, tenant_id),
        }
    }
}

/// The instruments of a collector that sets them at each scrape: their descriptions once, and
/// their families at each collect.
pub trait Instruments {
    fn all(&self) -> Vec<&dyn Collector>;

    fn descs(&self) -> Vec<Desc> {
        self.all().iter().flat_map(|i| i.desc()).cloned().collect()
    }

    fn families(&self) -> Vec<MetricFamily> {
        self.all().iter().flat_map(|i| i.collect()).collect()
    }
}

/// The value of the first series of family `name` in `registry` (a counter if the name ends in
/// `_total`, else a gauge); panics if there is none. For tests.
#[cfg(test)]
pub(crate) fn gathered_value(registry: &prometheus::Registry, name: &str) -> f64 {
    let families = registry.gather();
    let family = families.iter().find(|f| f.name() == name).unwrap_or_else(|| panic!("no {name}"));
    let metric = &family.get_metric()[0];
    if name.ends_with("_total") {
        metric.get_counter().get_value()
    } else {
        metric.get_gauge().get_value()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_series_carry_its_id() {
        let series = RequestSeries::get_page("tenant-a");
        series.seconds.observe(0.001);
        series.errors.inc();
        let families: Vec<MetricFamily> = [series.seconds.collect(), series.errors.collect()].concat();
        for family in &families {
            let labels = family.get_metric()[0].get_label();
            assert_eq!(labels.len(), 1);
            assert_eq!((labels[0].name(), labels[0].value()), ("tenant_id", "tenant-a"));
        }
        assert_eq!(families[0].get_metric()[0].get_histogram().get_sample_count(), 1);
        assert_eq!(families[1].get_metric()[0].get_counter().get_value(), 1.0);
    }
}
