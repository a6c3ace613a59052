//! The daemon's settings (docs/settings.md): the file form read from `pageserver.toml` and
//! `-c key=value` overrides, composed into [`PageServerConf`] out of the settings structs the
//! parts own (`TenantsConf`, `WalRedoConf`, `PageServiceSettings`, ...), defaults included.
//! This module only parses, checks ranges and composes; only `server` sees the whole.
//!
//! Invariants:
//! - every setting has a default, so the daemon starts without a file;
//! - an unknown key or a bad value is an error that names the key: the daemon refuses to start
//!   rather than run with a setting it did not understand;
//! - the runtime form is built by destructuring the file form, so a new field cannot be
//!   forgotten.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;

use crate::compaction::{self, CompactionMode, CompactionSettings};
use crate::compaction_controller::{self, ControllerConf};
use crate::logging::LogFormat;
use crate::page_cache::{DEFAULT_PAGE_CACHE_SIZE, MAX_PAGE_CACHE_SIZE, MIN_PAGE_CACHE_SIZE};
use crate::page_service::{self, PageServiceIo, PageServiceSettings, MAX_MAX_CONNECTIONS};
use crate::redo_budget::DEFAULT_REDO_MEMORY_BUDGET;
use crate::remote::{self, RemoteStorageConfig};
use crate::storage::{StorageConf, DEFAULT_LAYER_SIZE, MAX_LAYER_SIZE, MIN_LAYER_SIZE};
use crate::tenant::wal_receiver::DEFAULT_WAL_MAX_RECORD_SIZE;
use crate::tenant::DEFAULT_WAIT_LSN_TIMEOUT;
use crate::tenants::TenantsConf;
use crate::walredo::{self, ProcessKind, WalRedoConf, DEFAULT_PROCESS_KIND};

pub const DEFAULT_WORKDIR: &str = ".pageserver";
pub const CONFIG_FILE_NAME: &str = "pageserver.toml";
pub const DEFAULT_PG_ADDR: &str = "127.0.0.1:64000";
pub const DEFAULT_HTTP_ADDR: &str = "127.0.0.1:9898";

/// Every duration setting lies in `MIN_DURATION..=MAX_DURATION`: far from the overflow of
/// `Instant + Duration`, and longer than any timeout a person means.
pub const MIN_DURATION: Duration = Duration::from_millis(1);
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);
/// `max_local_disk` is at least this (bytes): a bare number of this size or less is a mistake.
pub const MIN_MAX_LOCAL_DISK: u64 = 1 << 20;

/// `pageserver.toml` as written; see docs/settings.md.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ConfigFile {
    listen_pg_addr: String,
    listen_http_addr: String,
    walredo_process_kind: ProcessKind,
    #[serde(with = "humantime_serde")]
    wal_redo_timeout: Duration,
    #[serde(with = "humantime_serde")]
    walredo_idle_timeout: Duration,
    walredo_proc_path: Option<PathBuf>,
    walredo_pool_max: Option<usize>,
    #[serde(with = "humantime_serde")]
    wait_lsn_timeout: Duration,
    page_cache_size: ByteSize,
    layer_size: ByteSize,
    max_connections: usize,
    #[serde(with = "humantime_serde")]
    page_service_idle_timeout: Duration,
    page_service_io: PageServiceIo,
    walredo_memory_budget: ByteSize,
    wal_max_record_size: ByteSize,
    log_format: LogFormat,
    compaction: CompactionMode,
    gc_horizon: u64,
    compaction_image_threshold: usize,
    compaction_cpu_floor: f64,
    compaction_cpu_cap: f64,
    remote_storage: Option<RemoteStorageConfig>,
    #[serde(with = "humantime_serde")]
    checkpoint_timeout: Duration,
    max_local_disk: Option<ByteSize>,
}

impl Default for ConfigFile {
    fn default() -> ConfigFile {
        ConfigFile {
            listen_pg_addr: DEFAULT_PG_ADDR.to_string(),
            listen_http_addr: DEFAULT_HTTP_ADDR.to_string(),
            walredo_process_kind: DEFAULT_PROCESS_KIND,
            wal_redo_timeout: walredo::DEFAULT_WAL_REDO_TIMEOUT,
            walredo_idle_timeout: walredo::DEFAULT_IDLE_TIMEOUT,
            walredo_proc_path: None,
            walredo_pool_max: None,
            wait_lsn_timeout: DEFAULT_WAIT_LSN_TIMEOUT,
            page_cache_size: ByteSize::with_unit(DEFAULT_PAGE_CACHE_SIZE),
            layer_size: ByteSize::with_unit(DEFAULT_LAYER_SIZE),
            max_connections: page_service::DEFAULT_MAX_CONNECTIONS,
            page_service_idle_timeout: page_service::DEFAULT_IDLE_TIMEOUT,
            page_service_io: PageServiceIo::default(),
            walredo_memory_budget: ByteSize::with_unit(DEFAULT_REDO_MEMORY_BUDGET),
            wal_max_record_size: ByteSize::with_unit(u64::from(DEFAULT_WAL_MAX_RECORD_SIZE)),
            log_format: LogFormat::Plain,
            compaction: CompactionMode::Sliced,
            gc_horizon: compaction::DEFAULT_GC_HORIZON,
            compaction_image_threshold: compaction::DEFAULT_IMAGE_THRESHOLD,
            compaction_cpu_floor: compaction_controller::DEFAULT_FLOOR,
            compaction_cpu_cap: compaction_controller::DEFAULT_CAP,
            remote_storage: None,
            checkpoint_timeout: remote::DEFAULT_CHECKPOINT_TIMEOUT,
            max_local_disk: None,
        }
    }
}

/// The settings in force: the daemon's own (where it runs, what it listens on, how it logs)
/// and each part's settings struct, composed from the file. Only the server sees all of it.
#[derive(Debug, Clone)]
pub struct PageServerConf {
    pub workdir: PathBuf,
    pub listen_pg_addr: SocketAddr,
    pub listen_http_addr: SocketAddr,
    pub log_format: LogFormat,
    /// 0 disables the page cache.
    pub page_cache_size: u64,
    pub page_service: PageServiceSettings,
    pub tenants: TenantsConf,
}

impl PageServerConf {
    /// Reads `<workdir>/pageserver.toml` (if present) and applies `overrides` (`key=value`).
    pub fn load(workdir: &Path, overrides: &[String]) -> anyhow::Result<PageServerConf> {
        let path = workdir.join(CONFIG_FILE_NAME);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
        };
        let mut table: toml::Table =
            toml::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
        for item in overrides {
            let (key, value) = parse_override(item)?;
            table.insert(key, value);
        }
        Self::from_table(workdir, table)
    }

    /// Builds the settings from a TOML table (file and overrides merged).
    pub fn from_table(workdir: &Path, table: toml::Table) -> anyhow::Result<PageServerConf> {
        // Round-trip through text: toml's errors then name the offending key.
        let text = toml::to_string(&table).context("re-encode settings")?;
        let file: ConfigFile = toml::from_str(&text).map_err(|e| {
            // Name the key: the error's span points into the line `key = value`, or into a
            // table's section (`[remote_storage]`, as the re-encoding writes an inline table),
            // whose name is the setting's.
            let before = e.span().map(|span| &text[..span.start.min(text.len())]);
            let section = before
                .and_then(|b| b.lines().rev().find(|l| l.trim_start().starts_with('[')))
                .map(|l| l.trim().trim_matches(|c| c == '[' || c == ']').to_string());
            let key = match section {
                Some(section) => Some(section),
                None => before
                    .and_then(|b| b.rsplit('\n').next())
                    .and_then(|line| line.split('=').next())
                    .map(str::trim)
                    .filter(|key| !key.is_empty())
                    .map(str::to_string),
            };
            match key {
                Some(key) => anyhow::anyhow!("invalid setting {key}: {}", e.message()),
                None => anyhow::anyhow!("invalid setting: {}", e.message()),
            }
        })?;
        let ConfigFile {
            listen_pg_addr,
            listen_http_addr,
            walredo_process_kind,
            wal_redo_timeout,
            walredo_idle_timeout,
            walredo_proc_path,
            walredo_pool_max,
            wait_lsn_timeout,
            page_cache_size,
            layer_size,
            max_connections,
            page_service_idle_timeout,
            page_service_io,
            walredo_memory_budget,
            wal_max_record_size,
            log_format,
            compaction,
            gc_horizon,
            compaction_image_threshold,
            compaction_cpu_floor,
            compaction_cpu_cap,
            remote_storage,
            checkpoint_timeout,
            max_local_disk,
        } = file;
        let addr = |key: &str, value: &str| resolve_addr(key, value);
        let duration = |key: &str, d: Duration| -> anyhow::Result<Duration> {
            anyhow::ensure!(
                (MIN_DURATION..=MAX_DURATION).contains(&d),
                "invalid setting {key} = {:?}: must be from 1 ms to 24 h",
                humantime::format_duration(d).to_string()
            );
            Ok(d)
        };
        anyhow::ensure!(
            (1..=MAX_MAX_CONNECTIONS).contains(&max_connections),
            "invalid setting max_connections = {max_connections}: must be from 1 to {MAX_MAX_CONNECTIONS}"
        );
        anyhow::ensure!(
            (MIN_LAYER_SIZE..=MAX_LAYER_SIZE).contains(&layer_size.bytes),
            "invalid setting layer_size = {}: must be from 64 KiB to 16 GiB",
            layer_size.bytes
        );
        check_page_cache_size(page_cache_size)?;
        let max_pool_size = walredo_pool_max.unwrap_or_else(walredo::pool::default_max_pool_size);
        let max_pools = walredo::pool::MAX_POOL_SIZE;
        anyhow::ensure!(
            (1..=max_pools).contains(&max_pool_size),
            "invalid setting walredo_pool_max = {max_pool_size}: must be from 1 to {max_pools}"
        );
        anyhow::ensure!(
            (1 << 20..=1 << 40).contains(&walredo_memory_budget.bytes),
            "invalid setting walredo_memory_budget = {}: must be from 1 MiB to 1 TiB",
            walredo_memory_budget.bytes
        );
        // 1 GiB is PostgreSQL's own bound (the decoder takes at most 1 GiB - 1 whatever this says).
        let wal_max_record_size = u32::try_from(wal_max_record_size.bytes)
            .ok()
            .filter(|size| (1 << 20..=1 << 30).contains(size))
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "invalid setting wal_max_record_size = {}: must be from 1 MiB to 1 GiB",
                    wal_max_record_size.bytes
                )
            })?;
        anyhow::ensure!(
            (1..=page_types::MAX_RECORDS_PER_REQUEST).contains(&compaction_image_threshold),
            "invalid setting compaction_image_threshold = {compaction_image_threshold}: must be from 1 to {}",
            page_types::MAX_RECORDS_PER_REQUEST
        );
        let controller = ControllerConf {
            floor: compaction_cpu_floor,
            cap: compaction_cpu_cap,
            ..ControllerConf::default()
        };
        controller.validate().map_err(|e| {
            anyhow::anyhow!(
                "invalid setting compaction_cpu_floor = {compaction_cpu_floor} or compaction_cpu_cap = {compaction_cpu_cap}: {e:#}"
            )
        })?;
        if let Some(remote) = &remote_storage {
            remote.validate().map_err(|e| anyhow::anyhow!("invalid setting remote_storage: {e:#}"))?;
        }
        if let Some(max) = max_local_disk {
            anyhow::ensure!(
                max.bytes >= MIN_MAX_LOCAL_DISK,
                "invalid setting max_local_disk = {}: must be at least 1 MiB (a size with a unit, e.g. \"100 GiB\")",
                max.bytes
            );
        }
        let binary = match walredo_proc_path {
            Some(path) => path,
            None => walredo::default_binary_path()?,
        };
        Ok(PageServerConf {
            workdir: workdir.to_path_buf(),
            listen_pg_addr: addr("listen_pg_addr", &listen_pg_addr)?,
            listen_http_addr: addr("listen_http_addr", &listen_http_addr)?,
            log_format,
            page_cache_size: page_cache_size.bytes,
            page_service: PageServiceSettings {
                max_connections,
                idle_timeout: duration("page_service_idle_timeout", page_service_idle_timeout)?,
                io: page_service_io,
            },
            tenants: TenantsConf {
                walredo: WalRedoConf {
                    process_kind: walredo_process_kind,
                    timeout: duration("wal_redo_timeout", wal_redo_timeout)?,
                    idle_timeout: duration("walredo_idle_timeout", walredo_idle_timeout)?,
                    max_pool_size,
                    ..WalRedoConf::with_binary(binary)
                },
                storage: StorageConf { layer_size: layer_size.bytes, ..Default::default() },
                compaction: CompactionSettings {
                    mode: compaction,
                    gc_horizon,
                    image_threshold: compaction_image_threshold,
                    controller,
                },
                wait_lsn_timeout: duration("wait_lsn_timeout", wait_lsn_timeout)?,
                walredo_memory_budget: walredo_memory_budget.bytes,
                wal_max_record_size,
                remote_storage,
                checkpoint_timeout: duration("checkpoint_timeout", checkpoint_timeout)?,
                max_local_disk: max_local_disk.map(|m| m.bytes),
            },
        })
    }
}

/// `page_cache_size` is 0 or from 1 MiB to 1 TiB. Neon's setting of the same name counts 8 KiB
/// pages, so a bare number below 1 MiB is almost surely a page count carried over: say so.
fn check_page_cache_size(size: ByteSize) -> anyhow::Result<()> {
    let bytes = size.bytes;
    if bytes == 0 || (MIN_PAGE_CACHE_SIZE..=MAX_PAGE_CACHE_SIZE).contains(&bytes) {
        return Ok(());
    }
    if size.bare && bytes < MIN_PAGE_CACHE_SIZE {
        anyhow::bail!(
            "invalid setting page_cache_size = {bytes}: this is bytes, not a page count as in Neon's \
             pageserver; write a size with a unit, e.g. \"{} MiB\" for {bytes} pages of 8 KiB \
             (0 disables the cache, otherwise from 1 MiB to 1 TiB)",
            (bytes * 8192).div_ceil(1 << 20).max(1)
        );
    }
    anyhow::bail!("invalid setting page_cache_size = {bytes}: must be 0 (off) or from 1 MiB to 1 TiB")
}

/// `host:port`, where host is an IP address or a name (`localhost:0`); a name is resolved once,
/// at start-up, to its first address.
fn resolve_addr(key: &str, value: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    if let Ok(addr) = value.parse() {
        return Ok(addr);
    }
    let mut addrs =
        value.to_socket_addrs().map_err(|e| anyhow::anyhow!("invalid setting {key} = {value:?}: {e}"))?;
    addrs.next().ok_or_else(|| anyhow::anyhow!("invalid setting {key} = {value:?}: the name has no address"))
}

/// Splits `key=value`; the value is TOML, or else taken as a plain string.
fn parse_override(item: &str) -> anyhow::Result<(String, toml::Value)> {
    let (key, raw) = item.split_once('=').with_context(|| format!("override {item:?} is not key=value"))?;
    let key = key.trim();
    anyhow::ensure!(!key.is_empty(), "override {item:?} has no key");
    let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.trim().to_string()),
    };
    Ok((key.to_string(), value))
}

/// A size in bytes, written as a number or as `"<number> <unit>"` (B, KiB, MiB, GiB, TiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize {
    pub bytes: u64,
    /// Written as a bare number (no unit): ambiguous for settings that other systems count in
    /// pages.
    pub bare: bool,
}

impl ByteSize {
    pub const fn with_unit(bytes: u64) -> ByteSize {
        ByteSize { bytes, bare: false }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<ByteSize, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Number(bytes) => Ok(ByteSize { bytes, bare: true }),
            Raw::Text(text) => parse_size(&text).map(ByteSize::with_unit).map_err(serde::de::Error::custom),
        }
    }
}

fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().map_err(|_| format!("size {text:?} does not start with a number"))?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            return Err(format!("size {text:?} has unknown unit {other:?}; use B, KiB, MiB, GiB or TiB"))
        }
    };
    number.checked_mul(multiplier).ok_or_else(|| format!("size {text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(overrides: &[&str]) -> anyhow::Result<PageServerConf> {
        let dir = tempfile::tempdir().unwrap();
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        PageServerConf::load(dir.path(), &overrides)
    }

    #[test]
    fn defaults_need_no_file() {
        let conf = load(&[]).unwrap();
        assert_eq!(conf.listen_pg_addr.to_string(), DEFAULT_PG_ADDR);
        assert_eq!(conf.listen_http_addr.to_string(), DEFAULT_HTTP_ADDR);
        assert_eq!(conf.tenants.walredo.process_kind, DEFAULT_PROCESS_KIND);
        assert_eq!(conf.tenants.walredo.timeout, Duration::from_secs(60));
        assert_eq!(conf.page_cache_size, DEFAULT_PAGE_CACHE_SIZE);
    }

    #[test]
    fn file_and_overrides_combine_with_overrides_winning() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(CONFIG_FILE_NAME),
            "walredo_process_kind = \"sync\"\nwal_redo_timeout = \"5 s\"\npage_cache_size = \"64 MiB\"\n",
        )
        .unwrap();
        let conf = PageServerConf::load(
            dir.path(),
            &["walredo_process_kind=async".to_string(), "wait_lsn_timeout=\"500 ms\"".to_string()],
        )
        .unwrap();
        assert_eq!(conf.tenants.walredo.process_kind, ProcessKind::Async);
        assert_eq!(conf.tenants.walredo.timeout, Duration::from_secs(5));
        assert_eq!(conf.tenants.wait_lsn_timeout, Duration::from_millis(500));
        assert_eq!(conf.page_cache_size, 64 << 20);
    }

    #[test]
    fn unknown_key_is_refused_by_name() {
        let err = load(&["no_such_setting=1"]).unwrap_err();
        assert!(format!("{err:#}").contains("no_such_setting"), "{err:#}");
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        for (item, key) in [
            ("walredo_process_kind=fast", "walredo_process_kind"),
            ("listen_pg_addr=nowhere", "listen_pg_addr"),
            ("wal_redo_timeout=\"soon\"", "wal_redo_timeout"),
            ("page_cache_size=\"12 parsecs\"", "page_cache_size"),
            ("max_connections=0", "max_connections"),
            ("max_connections=\"many\"", "max_connections"),
        ] {
            let err = load(&[item]).unwrap_err();
            assert!(format!("{err:#}").contains(key), "{item}: {err:#}");
        }
    }

    #[test]
    fn out_of_range_durations_sizes_and_counts_are_refused_by_name() {
        for (item, key) in [
            ("wal_redo_timeout=\"500000000000 years\"", "wal_redo_timeout"),
            ("walredo_idle_timeout=\"500000000000 years\"", "walredo_idle_timeout"),
            ("wait_lsn_timeout=\"500000000000 years\"", "wait_lsn_timeout"),
            ("wal_redo_timeout=\"2 days\"", "wal_redo_timeout"),
            ("wal_redo_timeout=\"10 us\"", "wal_redo_timeout"),
            ("wait_lsn_timeout=\"0 s\"", "wait_lsn_timeout"),
            ("page_cache_size=\"2000 GiB\"", "page_cache_size"),
            ("page_cache_size=\"512 KiB\"", "page_cache_size"),
            ("layer_size=\"100 GiB\"", "layer_size"),
            ("layer_size=\"1 KiB\"", "layer_size"),
            ("max_connections=1000000000000", "max_connections"),
        ] {
            let err = load(&[item]).unwrap_err();
            assert!(format!("{err:#}").contains(key), "{item}: {err:#}");
        }
    }

    #[test]
    fn the_bounds_themselves_are_accepted() {
        let conf = load(&[
            "wal_redo_timeout=\"1 day\"",
            "walredo_idle_timeout=\"1 ms\"",
            "wait_lsn_timeout=\"24 h\"",
            "page_cache_size=\"1 TiB\"",
            "layer_size=\"16 GiB\"",
            "max_connections=100000",
        ])
        .unwrap();
        assert_eq!(conf.tenants.walredo.timeout, MAX_DURATION);
        assert_eq!(conf.tenants.walredo.idle_timeout, MIN_DURATION);
        assert_eq!(conf.page_cache_size, 1 << 40);
        assert_eq!(conf.tenants.storage.layer_size, 16 << 30);
        assert_eq!(conf.page_service.max_connections, MAX_MAX_CONNECTIONS);
        assert_eq!(load(&["page_cache_size=\"1 MiB\""]).unwrap().page_cache_size, 1 << 20);
        assert_eq!(load(&["page_cache_size=0"]).unwrap().page_cache_size, 0);
    }

    #[test]
    fn a_bare_page_cache_size_below_one_mib_is_refused_as_a_neon_page_count() {
        for item in ["page_cache_size=8192", "page_cache_size=1000"] {
            let err = format!("{:#}", load(&[item]).unwrap_err());
            assert!(err.contains("page_cache_size") && err.contains("page count"), "{item}: {err}");
            assert!(err.contains("MiB"), "the message shows how to write a size: {err}");
        }
        assert_eq!(load(&["page_cache_size=1048576"]).unwrap().page_cache_size, 1 << 20);
    }

    #[test]
    fn wal_max_record_size_takes_a_size_within_its_bounds() {
        assert_eq!(load(&[]).unwrap().tenants.wal_max_record_size, DEFAULT_WAL_MAX_RECORD_SIZE);
        let conf = load(&["wal_max_record_size=\"16 MiB\""]).unwrap();
        assert_eq!(conf.tenants.wal_max_record_size, 16 << 20);
        assert_eq!(load(&["wal_max_record_size=\"1 GiB\""]).unwrap().tenants.wal_max_record_size, 1 << 30);
        assert_eq!(load(&["wal_max_record_size=1048576"]).unwrap().tenants.wal_max_record_size, 1 << 20);
        for item in [
            "wal_max_record_size=\"512 KiB\"",
            "wal_max_record_size=\"2 GiB\"",
            "wal_max_record_size=\"lots\"",
            "wal_max_record_size=0",
        ] {
            let err = format!("{:#}", load(&[item]).unwrap_err());
            assert!(err.contains("wal_max_record_size"), "{item}: {err}");
        }
    }

    #[test]
    fn max_local_disk_is_a_size_of_at_least_a_mib_and_absent_by_default() {
        assert_eq!(load(&[]).unwrap().tenants.max_local_disk, None);
        assert_eq!(load(&["max_local_disk=\"100 GiB\""]).unwrap().tenants.max_local_disk, Some(100 << 30));
        for item in ["max_local_disk=\"512 KiB\"", "max_local_disk=4096", "max_local_disk=\"much\""] {
            let err = format!("{:#}", load(&[item]).unwrap_err());
            assert!(err.contains("max_local_disk"), "{item}: {err}");
        }
    }

    #[test]
    fn listen_addresses_take_host_names() {
        let conf = load(&["listen_pg_addr=\"localhost:0\"", "listen_http_addr=\"localhost:7\""]).unwrap();
        assert!(conf.listen_pg_addr.ip().is_loopback(), "{}", conf.listen_pg_addr);
        assert_eq!(conf.listen_http_addr.port(), 7);
        let err = load(&["listen_pg_addr=\"localhost\""]).unwrap_err();
        assert!(format!("{err:#}").contains("listen_pg_addr"), "{err:#}");
    }

    #[test]
    fn remote_storage_takes_either_form_on_the_command_line_and_names_itself_when_wrong() {
        let conf = load(&[
            r#"remote_storage={bucket_name="b", bucket_region="eu-west-1", endpoint="http://127.0.0.1:7070"}"#,
            "checkpoint_timeout=\"5 s\"",
        ])
        .unwrap();
        let remote = conf.tenants.remote_storage.unwrap();
        assert_eq!(
            (remote.bucket_name.as_deref(), remote.endpoint.as_deref()),
            (Some("b"), Some("http://127.0.0.1:7070"))
        );
        assert_eq!(conf.tenants.checkpoint_timeout, Duration::from_secs(5));
        let local = load(&[r#"remote_storage={local_path="/var/lib/bucket"}"#]).unwrap();
        assert_eq!(local.tenants.remote_storage.unwrap().local_path, Some(PathBuf::from("/var/lib/bucket")));
        assert!(load(&[]).unwrap().tenants.remote_storage.is_none());
        for bad in
            [r#"remote_storage={bucket_name="b"}"#, r#"remote_storage={bucket="b"}"#, "remote_storage=3"]
        {
            let err = format!("{:#}", load(&[bad]).unwrap_err());
            assert!(err.contains("remote_storage"), "{bad}: {err}");
        }
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("64 KiB"), Ok(64 << 10));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("1 PB").is_err());
        assert!(parse_size("99999999999999 GiB").is_err());
    }
}
