//! The page cache: reconstructed pages, shared by all tenants, bounded in bytes.
//!
//! A page version is identified by its tenant (a per-process generation number, so a tenant
//! deleted and created again never sees the old one's pages), its key, and the LSN of the
//! newest value at or below the requested LSN: every request LSN between two changes of a page
//! maps to the same version, so "latest" reads hit the cache until the page changes.
//!
//! Invariants: page bytes are `Bytes` shared with every reader, never copied per reply; the
//! cache never holds more than `page_cache_size` bytes of pages (0 disables it).

use bytes::Bytes;
use page_types::{BufferTag, Lsn};
use prometheus::{IntGauge, Opts, Registry};

use crate::metrics::sharded::ShardedCounter;

/// Default of `page_cache_size`.
pub const DEFAULT_PAGE_CACHE_SIZE: u64 = 128 << 20;
/// `page_cache_size` is 0 (off) or in `MIN_PAGE_CACHE_SIZE..=MAX_PAGE_CACHE_SIZE`.
pub const MIN_PAGE_CACHE_SIZE: u64 = 1 << 20;
pub const MAX_PAGE_CACHE_SIZE: u64 = 1 << 40;

/// What identifies one page version: the tenant's generation, the key, the LSN of the version.
pub type CacheKey = (u64, BufferTag, Lsn);

#[derive(Clone)]
struct PageWeight;

impl quick_cache::Weighter<CacheKey, Bytes> for PageWeight {
    fn weight(&self, _key: &CacheKey, page: &Bytes) -> u64 {
        // Key and bookkeeping are small next to the page; count the page.
        page.len() as u64
    }
}

pub struct PageCache {
    cache: Option<quick_cache::sync::Cache<CacheKey, Bytes, PageWeight>>,
    /// In shards: every GetPage counts one or the other, on any core.
    hits: ShardedCounter,
    misses: ShardedCounter,
    bytes: IntGauge,
}

impl PageCache {
    pub fn new(size_bytes: u64, registry: &Registry) -> anyhow::Result<PageCache> {
        let counter = |name: &str, help: &str| -> anyhow::Result<ShardedCounter> {
            let c = ShardedCounter::new(Opts::new(name, help))?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let bytes = IntGauge::new("pageserver_page_cache_bytes", "Bytes of pages held by the page cache")?;
        registry.register(Box::new(bytes.clone()))?;
        let capacity = IntGauge::new("pageserver_page_cache_capacity_bytes", "Configured page cache size")?;
        registry.register(Box::new(capacity.clone()))?;
        capacity.set(i64::try_from(size_bytes).unwrap_or(i64::MAX));
        let pages = (size_bytes / page_types::PAGE_SIZE as u64) as usize;
        Ok(PageCache {
            cache: (pages > 0)
                .then(|| quick_cache::sync::Cache::with_weighter(pages, size_bytes, PageWeight)),
            hits: counter("pageserver_page_cache_hits_total", "Page cache lookups that found the page")?,
            misses: counter("pageserver_page_cache_misses_total", "Page cache lookups that did not")?,
            bytes,
        })
    }

    /// Whether the cache holds anything (`page_cache_size` is not 0).
    pub fn enabled(&self) -> bool {
        self.cache.is_some()
    }

    pub fn get(&self, key: &CacheKey) -> Option<Bytes> {
        let found = self.cache.as_ref().and_then(|c| c.get(key));
        if found.is_some() {
            self.hits.inc();
        } else {
            self.misses.inc();
        }
        found
    }

    /// Caches a copy of `page`: a page read off a redo child or out of a layer is a slice of a
    /// larger buffer (the reader's chunk, a lookup's read), which a cached slice would keep
    /// alive, unaccounted, for as long as the page stays cached.
    pub fn insert(&self, key: CacheKey, page: &[u8]) {
        if let Some(cache) = &self.cache {
            cache.insert(key, Bytes::copy_from_slice(page));
            self.bytes.set(i64::try_from(cache.weight()).unwrap_or(i64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(blknum: u32, lsn: u64) -> CacheKey {
        (1, BufferTag { spcnode: 1, dbnode: 2, relnode: 3, forknum: 0, blknum }, Lsn(lsn))
    }

    #[test]
    fn cache_keeps_a_copy_of_its_own_and_returns_it_without_copying() {
        let cache = PageCache::new(1 << 20, &Registry::new()).unwrap();
        // A page sliced from a larger buffer, as the redo reader's pages are.
        let chunk = Bytes::from(vec![7u8; 4 * 8192]);
        let page = chunk.slice(8192..2 * 8192);
        cache.insert(key(1, 10), &page);
        let got = cache.get(&key(1, 10)).unwrap();
        assert_eq!(got, page);
        assert!(!chunk.as_ptr_range().contains(&got.as_ptr()), "the cache must not keep the chunk alive");
        assert_eq!(cache.get(&key(1, 10)).unwrap().as_ptr(), got.as_ptr());
        assert!(cache.get(&key(1, 11)).is_none());
        assert_eq!((cache.hits.get(), cache.misses.get()), (2, 1));
    }

    #[test]
    fn cache_stays_within_its_byte_bound() {
        let cache = PageCache::new(64 * 8192, &Registry::new()).unwrap();
        for n in 0..1000 {
            cache.insert(key(n, 1), &[0u8; 8192]);
        }
        assert!(cache.bytes.get() <= 64 * 8192, "{}", cache.bytes.get());
        assert!(cache.bytes.get() > 0);
    }

    #[test]
    fn zero_size_disables_the_cache() {
        let cache = PageCache::new(0, &Registry::new()).unwrap();
        cache.insert(key(1, 1), &[0u8; 8192]);
        assert!(cache.get(&key(1, 1)).is_none());
        assert!(!cache.enabled());
    }
}
