//! The `remote_storage` setting, in Neon's two forms:
//! `{bucket_name, bucket_region, prefix_in_bucket?, endpoint?}` (S3 or an S3-compatible server;
//! an endpoint means path-style addressing, `http://` allowed) or `{local_path}` (a directory as
//! the bucket, for one machine). Credentials are read the standard way by `object_store`:
//! `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`), web identity, the
//! container's or the instance's metadata service.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;
use serde::Deserialize;

/// `remote_storage = {...}` as written; checked by [`RemoteStorageConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteStorageConfig {
    #[serde(default)]
    pub bucket_name: Option<String>,
    #[serde(default)]
    pub bucket_region: Option<String>,
    #[serde(default)]
    pub prefix_in_bucket: Option<String>,
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default)]
    pub local_path: Option<PathBuf>,
}

impl RemoteStorageConfig {
    /// Fails, naming the fields, unless exactly one of the two forms is given.
    pub fn validate(&self) -> anyhow::Result<()> {
        match (&self.local_path, &self.bucket_name) {
            (Some(_), None) => {
                anyhow::ensure!(
                    self.bucket_region.is_none()
                        && self.prefix_in_bucket.is_none()
                        && self.endpoint.is_none(),
                    "local_path takes no bucket_region, prefix_in_bucket or endpoint"
                );
                Ok(())
            }
            (None, Some(bucket)) => {
                anyhow::ensure!(!bucket.is_empty(), "bucket_name is empty");
                anyhow::ensure!(self.bucket_region.is_some(), "bucket_name needs bucket_region");
                if let Some(endpoint) = &self.endpoint {
                    anyhow::ensure!(
                        endpoint.starts_with("http://") || endpoint.starts_with("https://"),
                        "endpoint {endpoint:?} is not an http:// or https:// URL"
                    );
                }
                Ok(())
            }
            (Some(_), Some(_)) => anyhow::bail!("give either local_path or bucket_name, not both"),
            (None, None) => anyhow::bail!("give local_path, or bucket_name and bucket_region"),
        }
    }

    /// For messages: the bucket and prefix, or the directory.
    pub fn describe(&self) -> String {
        match (&self.local_path, &self.bucket_name) {
            (Some(path), _) => format!("local_path {}", path.display()),
            (None, bucket) => format!(
                "bucket {}{}{}",
                bucket.as_deref().unwrap_or(""),
                self.prefix_in_bucket.as_deref().map(|p| format!(" prefix {p}")).unwrap_or_default(),
                self.endpoint.as_deref().map(|e| format!(" at {e}")).unwrap_or_default()
            ),
        }
    }

    /// The store and the prefix in it.
    pub(super) fn build(&self) -> anyhow::Result<(Arc<dyn ObjectStore>, ObjectPath)> {
        self.validate()?;
        if let Some(path) = &self.local_path {
            std::fs::create_dir_all(path).with_context(|| format!("create {}", path.display()))?;
            let store = object_store::local::LocalFileSystem::new_with_prefix(path)
                .with_context(|| format!("remote storage local_path {}", path.display()))?;
            return Ok((Arc::new(store), ObjectPath::default()));
        }
        let mut builder = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(self.bucket_name.clone().unwrap_or_default())
            .with_region(self.bucket_region.clone().unwrap_or_default());
        if let Some(endpoint) = &self.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        let store = builder.build().with_context(|| format!("remote storage {}", self.describe()))?;
        let prefix = ObjectPath::from(self.prefix_in_bucket.as_deref().unwrap_or("").trim_matches('/'));
        Ok((Arc::new(store), prefix))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(text: &str) -> anyhow::Result<RemoteStorageConfig> {
        let table: toml::Table = toml::from_str(&format!("remote_storage = {text}"))?;
        let conf: RemoteStorageConfig = table["remote_storage"].clone().try_into()?;
        conf.validate()?;
        Ok(conf)
    }

    #[test]
    fn both_forms_parse_and_a_mix_or_a_half_is_refused_by_name() {
        let s3 = parse(r#"{bucket_name = "b", bucket_region = "us-east-1", prefix_in_bucket = "p/", endpoint = "http://127.0.0.1:7070"}"#)
            .unwrap();
        assert_eq!(s3.bucket_name.as_deref(), Some("b"));
        let (_, prefix) = s3.build().unwrap();
        assert_eq!(prefix.as_ref(), "p");
        let dir = tempfile::tempdir().unwrap();
        let local = parse(&format!("{{local_path = {:?}}}", dir.path().join("bucket"))).unwrap();
        local.build().unwrap();
        assert!(dir.path().join("bucket").is_dir());
        for (text, says) in [
            (r#"{bucket_name = "b"}"#, "bucket_region"),
            (r#"{local_path = "/x", bucket_name = "b", bucket_region = "r"}"#, "not both"),
            (r#"{}"#, "local_path"),
            (r#"{bucket_name = "b", bucket_region = "r", endpoint = "127.0.0.1:1"}"#, "endpoint"),
            (r#"{bucket = "b"}"#, "bucket"),
        ] {
            let e = format!("{:#}", parse(text).unwrap_err());
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
