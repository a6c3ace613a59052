//! Per-tenant metrics, with a bounded number of series.
//!
//! Every tenant counts its own GetPage and redo requests ([`crate::metrics::RequestSeries`]:
//! histograms and counters labelled `tenant_id`, kept in the tenant and its redo manager,
//! registered nowhere). At each scrape of
//! `/metrics` the daemon's [`TenantSeriesCollector`] exports them for the [`MAX_TENANTS`]
//! busiest tenants only, so that a daemon of thousands of tenants still exports a few hundred
//! per-tenant series. Busy means time spent: the GetPage and redo seconds a tenant added since
//! the previous scrape, plus half its score of the scrape before ([`Ranking`]); so a tenant
//! stays in the set for a few scrapes after its load stops, and a new busy tenant gets in at
//! its first busy scrape. A tenant out of the set keeps counting: when it comes back, its
//! counters have the whole count, so `rate()` over the gap is still right.
//!
//! Invariant: at most [`MAX_TENANTS`] tenants are exported per scrape; the selection is a pure
//! function of the tenants' cumulative seconds ([`Ranking::choose`]), tested on its own.

use std::collections::HashMap;
use std::sync::{Mutex, Weak};

use crate::metrics::{gauge, names};
use crate::tenants::Tenants;
use crate::util::lock;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;

/// Most tenants whose series one scrape exports.
pub const MAX_TENANTS: usize = 16;

/// Each scrape keeps this share of a tenant's earlier score.
const DECAY: f64 = 0.5;

/// Which tenants a scrape exports: the running scores of the tenants.
#[derive(Debug, Default)]
pub struct Ranking {
    /// Per tenant (by generation, unique per process): cumulative seconds at the last scrape,
    /// and the score.
    seen: HashMap<u64, (f64, f64)>,
}

impl Ranking {
    /// Takes each tenant's cumulative busy seconds now, updates the scores (the seconds added
    /// since the last call, plus [`DECAY`] of the old score), forgets tenants that are gone,
    /// and returns the indexes into `tenants` of at most `max` tenants with a score above 0,
    /// highest first (ties: lower generation first).
    pub fn choose(&mut self, tenants: &[(u64, f64)], max: usize) -> Vec<usize> {
        let mut seen = HashMap::with_capacity(tenants.len());
        let mut scored = Vec::with_capacity(tenants.len());
        for (i, &(generation, total)) in tenants.iter().enumerate() {
            let (last_total, last_score) = self.seen.get(&generation).copied().unwrap_or((0.0, 0.0));
            let added = (total - last_total).max(0.0);
            let score = last_score * DECAY + added;
            seen.insert(generation, (total, score));
            if score > 0.0 {
                scored.push((score, generation, i));
            }
        }
        self.seen = seen;
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        scored.into_iter().take(max).map(|(_, _, i)| i).collect()
    }
}

/// Exports the series of the busiest tenants at each scrape (the module doc).
pub struct TenantSeriesCollector {
    tenants: Weak<Tenants>,
    ranking: Mutex<Ranking>,
    descs: Vec<Desc>,
}

impl TenantSeriesCollector {
    pub fn new(tenants: Weak<Tenants>) -> anyhow::Result<TenantSeriesCollector> {
        let descs = [
            names::GET_PAGE_SECONDS,
            names::GET_PAGE_ERRORS,
            names::REDO_SECONDS,
            names::REDO_ERRORS,
            names::REDO_CHILDREN,
            names::REDO_SPINNING,
        ]
        .into_iter()
        .map(|(name, help)| Desc::new(name.into(), help.into(), vec!["tenant_id".into()], HashMap::new()))
        .collect::<Result<Vec<_>, _>>()?;
        Ok(TenantSeriesCollector { tenants, ranking: Mutex::new(Ranking::default()), descs })
    }
}

impl Collector for TenantSeriesCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(tenants) = self.tenants.upgrade() else { return Vec::new() };
        let active = tenants.active();
        let busy: Vec<(u64, f64)> = active
            .iter()
            .map(|t| {
                (
                    t.generation,
                    t.get_page_series.seconds.get_sample_sum() + t.walredo.series().seconds.get_sample_sum(),
                )
            })
            .collect();
        let chosen = lock(&self.ranking).choose(&busy, MAX_TENANTS);
        let mut families = Vec::new();
        for i in chosen {
            let tenant = &active[i];
            let redo = tenant.walredo.series();
            let (children, spinning) = tenant.walredo.children_and_spinning();
            let (children_name, children_help) = names::REDO_CHILDREN;
            let (spinning_name, spinning_help) = names::REDO_SPINNING;
            families.extend(tenant.get_page_series.seconds.collect());
            families.extend(tenant.get_page_series.errors.collect());
            families.extend(redo.seconds.collect());
            families.extend(redo.errors.collect());
            families.extend(gauge(children_name, children_help, &tenant.id, children as i64).collect());
            families.extend(gauge(spinning_name, spinning_help, &tenant.id, spinning as i64).collect());
        }
        // The registry merges families of the same name.
        families
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busiest_tenants_are_chosen_and_no_more_than_the_bound() {
        let mut ranking = Ranking::default();
        // Tenant g has spent g seconds; tenant 0 nothing at all.
        let tenants: Vec<(u64, f64)> = (0..40).map(|g| (g, g as f64)).collect();
        let chosen = ranking.choose(&tenants, MAX_TENANTS);
        assert_eq!(chosen.len(), MAX_TENANTS);
        let generations: Vec<u64> = chosen.iter().map(|&i| tenants[i].0).collect();
        assert_eq!(generations, (24..40).rev().collect::<Vec<u64>>());
    }

    #[test]
    fn an_idle_tenant_is_not_exported_at_all() {
        let mut ranking = Ranking::default();
        let chosen = ranking.choose(&[(1, 0.0), (2, 0.5)], MAX_TENANTS);
        assert_eq!(chosen, vec![1]);
        // Still nothing added: tenant 1 stays out, tenant 2 stays in on its decaying score.
        assert_eq!(ranking.choose(&[(1, 0.0), (2, 0.5)], MAX_TENANTS), vec![1]);
    }

    #[test]
    fn recent_load_outranks_old_load_after_a_few_scrapes() {
        let mut ranking = Ranking::default();
        // Tenant 1 was busy once (10 s), then idle; tenant 2 adds 2 s per scrape.
        assert_eq!(ranking.choose(&[(1, 10.0), (2, 2.0)], 1), vec![0]);
        let mut chosen = Vec::new();
        for scrape in 2..6 {
            chosen.push(ranking.choose(&[(1, 10.0), (2, 2.0 * scrape as f64)], 1));
        }
        // Scores of 1: 5, 2.5, 1.25, 0.6; of 2: 3, 3.5, 3.75, 3.9.
        assert_eq!(chosen, vec![vec![0], vec![1], vec![1], vec![1]]);
    }

    #[test]
    fn a_tenant_that_is_gone_is_forgotten_and_a_new_one_starts_from_zero() {
        let mut ranking = Ranking::default();
        ranking.choose(&[(1, 5.0), (2, 1.0)], MAX_TENANTS);
        assert_eq!(ranking.seen.len(), 2);
        ranking.choose(&[(2, 1.0)], MAX_TENANTS);
        assert_eq!(ranking.seen.len(), 1);
        // A re-created tenant has a new generation: its seconds count from its own start.
        let chosen = ranking.choose(&[(2, 1.0), (3, 0.25)], MAX_TENANTS);
        assert_eq!(chosen, vec![0, 1]);
        assert_eq!(ranking.seen[&3], (0.25, 0.25));
    }

    #[test]
    fn a_counter_that_goes_backwards_adds_nothing() {
        let mut ranking = Ranking::default();
        ranking.choose(&[(1, 5.0)], MAX_TENANTS);
        ranking.choose(&[(1, 4.0)], MAX_TENANTS);
        assert_eq!(ranking.seen[&1], (4.0, 2.5));
    }
}
