//! The endpoints a broker or Redis URL names: a clustered RabbitMQ is reached through any of its
//! nodes, a Redis Sentinel group through any of its sentinels, a Redis Cluster through any of
//! its nodes.
//!
//! One string holds them all, in the two forms the ecosystem's clients take (so a Secret keeps
//! one key): several URLs separated by commas (`amqp://a:5672/%2f,amqp://b:5672/%2f`), or one
//! URL with several hosts (`amqp://user:pass@a:5672,b:5672,c/vhost`, whose user, password, vhost
//! and query every host shares). Spaces around a comma are ignored.

use crate::Error;

/// The URLs `url` names, one per endpoint, in the order given: every one has a scheme and a host
/// (the error says which endpoint is wrong, never its password).
pub fn split(url: &str) -> Result<Vec<String>, Error> {
    let mut out = Vec::new();
    for group in groups(url) {
        let n = out.len();
        out.extend(expand(&group));
        for (i, u) in out.iter().enumerate().skip(n) {
            check(u, i + 1)?;
        }
    }
    if out.is_empty() {
        return Err(Error::Config("the URL is empty".into()));
    }
    Ok(out)
}

/// Several hosts given for one URL: `scheme://userinfo@h1,h2,h3/rest` as the separate pieces
/// (`scheme://userinfo@`, the hosts, `/rest`), `None` for a URL of one host.
pub fn hosts(url: &str) -> Option<(&str, Vec<&str>, &str)> {
    parts(url).filter(|(_, hosts, _)| hosts.len() > 1)
}

/// A URL's pieces around its hosts: `scheme://userinfo@`, the hosts (one or several), and what
/// follows them (`/rest?query`); `None` without a scheme.
pub fn parts(url: &str) -> Option<(&str, Vec<&str>, &str)> {
    let start = url.find("://")? + 3;
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    let authority = &url[start..end];
    let at = authority.rfind('@').map_or(start, |i| start + i + 1);
    let hosts: Vec<&str> = url[at..end].split(',').map(str::trim).collect();
    Some((&url[..at], hosts, &url[end..]))
}

/// The pieces of `url` that each start with a scheme, with the bare hosts that follow one put
/// back after it (`amqp://u@a:5672` `b:5672/v` → `amqp://u@a:5672,b:5672/v`).
fn groups(url: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for token in url.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        match out.last_mut() {
            Some(last) if !token.contains("://") => {
                last.push(',');
                last.push_str(token);
            }
            _ => out.push(token.to_string()),
        }
    }
    out
}

fn expand(url: &str) -> Vec<String> {
    match hosts(url) {
        Some((head, hosts, tail)) => hosts
            .into_iter()
            .map(|h| format!("{head}{h}{tail}"))
            .collect(),
        None => vec![url.to_string()],
    }
}

fn check(u: &str, n: usize) -> Result<(), Error> {
    let parsed = url::Url::parse(u).map_err(|e| {
        Error::Config(format!(
            "endpoint {n} of the URL is not a URL ({e}): {}",
            crate::redact::url(u)
        ))
    })?;
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(Error::Config(format!(
            "endpoint {n} of the URL has no host: {}",
            crate::redact::url(u)
        )));
    }
    Ok(())
}

/// The first endpoint of `url` (what names the broker's user and the ledger's scope), or `url`
/// itself when it does not split.
pub fn first(url: &str) -> String {
    split(url)
        .ok()
        .and_then(|v| v.into_iter().next())
        .unwrap_or_else(|| url.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_url_is_one_endpoint() {
        assert_eq!(
            split("amqp://guest:guest@127.0.0.1:5672/%2f").unwrap(),
            ["amqp://guest:guest@127.0.0.1:5672/%2f"]
        );
    }

    #[test]
    fn a_list_of_urls_keeps_its_order() {
        assert_eq!(
            split("amqp://a:5681/%2f, amqp://b:5682/%2f,amqps://c/v").unwrap(),
            ["amqp://a:5681/%2f", "amqp://b:5682/%2f", "amqps://c/v"]
        );
    }

    #[test]
    fn several_hosts_share_the_credentials_vhost_and_query() {
        assert_eq!(
            split("amqp://u:p%40ss@a:5681,b:5682,c/prod?heartbeat=10").unwrap(),
            [
                "amqp://u:p%40ss@a:5681/prod?heartbeat=10",
                "amqp://u:p%40ss@b:5682/prod?heartbeat=10",
                "amqp://u:p%40ss@c/prod?heartbeat=10",
            ]
        );
        assert_eq!(
            split("redis://h1:7000,h2:7001").unwrap(),
            ["redis://h1:7000", "redis://h2:7001"]
        );
    }

    #[test]
    fn a_bad_endpoint_is_named_without_its_password() {
        let e = split("amqp://u:secret@a:5672/%2f,amqp://u:secret@:5672/%2f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("endpoint 2"), "{e}");
        assert!(!e.contains("secret"), "{e}");
        assert!(split(" , ").is_err());
    }
}
