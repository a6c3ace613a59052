//! libpq's keyword/value connection strings (`host=db1 port=5432 user=replicator`), the form
//! an operator gives a WAL source: parsed into the few keywords a replication connection uses.
//!
//! Quoting follows libpq: a value may be single-quoted, and inside quotes (or bare) a backslash
//! escapes the next character. Keywords this client does not implement are refused by name
//! rather than ignored (an `sslmode=require` that silently went unencrypted would be worse than
//! an error), except for a few that only tune libpq itself and change nothing here.
//!
//! Invariant: pure; no input panics; the password never appears in `Debug` or an error.

use std::fmt;

/// Where and as whom to connect.
#[derive(Clone, PartialEq, Eq)]
pub struct ConnConfig {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: Option<String>,
    pub dbname: Option<String>,
    pub application_name: String,
}

impl fmt::Debug for ConnConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("dbname", &self.dbname)
            .field("application_name", &self.application_name)
            .finish()
    }
}

impl fmt::Display for ConnConfig {
    /// `user@host:port` (never the password).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}:{}", self.user, self.host, self.port)
    }
}

/// Keywords accepted and ignored: they tune libpq's own behaviour, which this client does not
/// have (it connects once per attempt, in plain TCP).
const IGNORED: &[&str] =
    &["connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count"];

/// Parses a keyword/value connection string. `host` defaults to `localhost`, `port` to 5432,
/// `user` is required (a daemon has no "current OS user" worth guessing), `sslmode` may be
/// `disable` or `allow`/`prefer` (then plain TCP, as libpq falls back), nothing stronger.
pub fn parse(text: &str) -> Result<ConnConfig, String> {
    let mut config = ConnConfig {
        host: "localhost".into(),
        port: 5432,
        user: String::new(),
        password: None,
        dbname: None,
        application_name: "pageserver".into(),
    };
    for (key, value) in pairs(text)? {
        match key.as_str() {
            "host" | "hostaddr" => {
                if value.contains(',') {
                    return Err(format!("{key}: several hosts are not supported"));
                }
                config.host = value;
            }
            "port" => {
                config.port = value.parse().map_err(|_| format!("port: {value:?} is not a port number"))?;
            }
            "user" => config.user = value,
            "password" => config.password = Some(value),
            "dbname" => config.dbname = Some(value),
            "application_name" => config.application_name = value,
            "sslmode" => match value.as_str() {
                "disable" | "allow" | "prefer" => {}
                other => return Err(format!("sslmode={other}: TLS is not supported; use sslmode=disable")),
            },
            k if IGNORED.contains(&k) => {}
            other => return Err(format!("unsupported connection keyword {other:?}")),
        }
    }
    if config.user.is_empty() {
        return Err("the connection string names no user (user=...)".into());
    }
    if config.host.is_empty() || config.host.starts_with('/') {
        return Err(format!(
            "host {:?}: a TCP host is required (Unix sockets are not supported)",
            config.host
        ));
    }
    Ok(config)
}

/// Splits `key = value` pairs, values bare or single-quoted, backslash escapes.
fn pairs(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(format!("missing \"=\" after {key:?} in the connection string"));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    None => return Err(format!("unterminated quoted value of {key:?}")),
                    Some('\'') => break,
                    Some('\\') => value.push(chars.next().ok_or_else(|| format!("dangling \\ in {key:?}"))?),
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.push(chars.next().ok_or_else(|| format!("dangling \\ in {key:?}"))?);
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn keywords_values_quotes_and_escapes_parse_like_libpq() {
        let c = parse("host=db1 port = 6543 user=rep password='it''s' dbname=postgres").unwrap_err();
        // libpq has no '' doubling inside quotes: the quote ends the value and `s'` follows.
        assert!(c.contains("missing"), "{c}");
        let c =
            parse(r"host=db1 port = 6543 user=rep password='it\'s a secret' application_name=x\ y").unwrap();
        assert_eq!((c.host.as_str(), c.port, c.user.as_str()), ("db1", 6543, "rep"));
        assert_eq!(c.password.as_deref(), Some("it's a secret"));
        assert_eq!(c.application_name, "x y");
        assert_eq!(c.dbname, None);
    }

    #[test]
    fn defaults_and_required_keywords() {
        let c = parse("user=u").unwrap();
        assert_eq!((c.host.as_str(), c.port), ("localhost", 5432));
        assert!(parse("host=h").unwrap_err().contains("no user"));
        assert!(parse("").unwrap_err().contains("no user"));
    }

    #[test]
    fn unsupported_settings_are_refused_by_name() {
        assert!(parse("user=u sslmode=require").unwrap_err().contains("sslmode=require"));
        assert!(parse("user=u target_session_attrs=any").unwrap_err().contains("target_session_attrs"));
        assert!(parse("user=u host=/var/run/postgresql").unwrap_err().contains("Unix"));
        assert!(parse("user=u host=a,b").unwrap_err().contains("several hosts"));
        assert!(parse("user=u port=99999").unwrap_err().contains("port"));
        assert!(parse("user=u password='open").unwrap_err().contains("unterminated"));
        assert!(parse("user=u connect_timeout=10").is_ok());
    }

    #[test]
    fn the_password_is_never_shown() {
        let c = parse("user=u password=hunter2").unwrap();
        assert!(!format!("{c:?} {c}").contains("hunter2"));
    }
}
