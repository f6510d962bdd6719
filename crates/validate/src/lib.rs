//! Reading a `DlqReplay` manifest and refusing bad ones before anything touches the broker.
//!
//! Every error names the field it is about (`spec.rate.messagesPerSecond: ...`), because the
//! person reading it is holding a YAML file, not our Rust types.
//!
//! The rules are the CRD's: [`validate_spec`] checks a spec against the schema and CEL rules of
//! [`dlq_replay_api::crd`] (see [`structural`]), so the command line, the operator and
//! `kubectl apply` refuse the same specs for the same reasons.

pub mod structural;

use dlq_replay_api as api;
use dlq_replay_engine::redact;

use std::sync::LazyLock;

use crate::api::{DlqReplay, DlqReplaySpec, API_VERSION, KIND};
use structural::CrdSchema;

/// A manifest that cannot be replayed, with the path of every offending field.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The text is not YAML (or JSON).
    #[error("manifest is not valid YAML: {0}")]
    Yaml(String),
    /// A field has the wrong shape.
    #[error("{path}: {message}")]
    Field {
        /// The field's path, e.g. `spec.rate.messagesPerSecond`.
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// Several fields have impossible values.
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
}

/// One field with an impossible value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field's path.
    pub path: String,
    /// What is wrong with it.
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

const TOP_LEVEL_FIELDS: [&str; 5] = ["apiVersion", "kind", "metadata", "spec", "status"];

/// Parse and validate a manifest.
pub fn parse(text: &str) -> Result<DlqReplay, ManifestError> {
    let value: serde_json::Value =
        serde_yaml::from_str(text).map_err(|e| ManifestError::Yaml(e.to_string()))?;
    check_envelope(&value)?;
    check_no_list_for_map(&value, crd_schema().schema(), "")?;
    let mut urls = Vec::new();
    urls_with_userinfo(&value, &mut urls);
    let replay: DlqReplay = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        // serde quotes the offending value (`invalid type: string "amqp://u:pw@h/"`): mask the
        // password of any URL the manifest holds.
        let mut message = e.into_inner().to_string();
        for u in &urls {
            message = message.replace(u.as_str(), &crate::redact::url(u));
        }
        ManifestError::Field {
            path: if path == "." { "(root)".into() } else { path },
            message,
        }
    })?;
    let mut errors = Vec::new();
    if replay.metadata.name.as_deref().unwrap_or("").is_empty() {
        errors.push(err("metadata.name", "is required"));
    }
    errors.extend(validate_spec(&replay.spec));
    if errors.is_empty() {
        Ok(replay)
    } else {
        Err(ManifestError::Invalid(errors))
    }
}

/// Read a manifest from a file (`-` for standard input).
pub fn load(path: &str) -> Result<DlqReplay, dlq_replay_engine::Error> {
    let text = if path == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|e| dlq_replay_engine::Error::Io(format!("cannot read {path}: {e}")))?;
    parse(&text).map_err(|e| dlq_replay_engine::Error::Manifest(format!("{path}: {e}")))
}

/// Every string in the manifest that looks like a URL with credentials (`scheme://user:pw@`).
fn urls_with_userinfo(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::String(s) if s.contains("://") && s.contains('@') => out.push(s.clone()),
        serde_json::Value::Array(items) => items.iter().for_each(|v| urls_with_userinfo(v, out)),
        serde_json::Value::Object(map) => map.values().for_each(|v| urls_with_userinfo(v, out)),
        _ => {}
    }
}

/// The CRD's structural schema (what `kubectl apply` is checked against), compiled once.
pub fn crd_schema() -> &'static CrdSchema {
    static SCHEMA: LazyLock<CrdSchema> = LazyLock::new(|| {
        CrdSchema::new(&crate::api::crd(), "v1alpha1")
            .unwrap_or_else(|e| panic!("api::crd() has a broken schema: {e}"))
    });
    &SCHEMA
}

/// serde lets a struct be written as the list of its fields in order (`source: [media.dlq]`);
/// the API server does not, so neither do we: a list where the schema has an object is refused.
fn check_no_list_for_map(
    value: &serde_json::Value,
    schema: &serde_json::Value,
    path: &str,
) -> Result<(), ManifestError> {
    match value {
        serde_json::Value::Array(items) => {
            if schema.get("type").and_then(|t| t.as_str()) == Some("object") {
                return Err(field(path, "invalid type: sequence, expected a map"));
            }
            if let Some(item) = schema.get("items").filter(|i| i.is_object()) {
                for (i, v) in items.iter().enumerate() {
                    check_no_list_for_map(v, item, &format!("{path}[{i}]"))?;
                }
            }
        }
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let sub = schema.get("properties").and_then(|p| p.get(k));
                let sub = sub.or(schema.get("additionalProperties").filter(|a| a.is_object()));
                if let Some(sub) = sub {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    check_no_list_for_map(v, sub, &p)?;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

fn check_envelope(value: &serde_json::Value) -> Result<(), ManifestError> {
    let Some(map) = value.as_object() else {
        return Err(field(
            "(root)",
            "must be a mapping with apiVersion, kind, metadata and spec",
        ));
    };
    if let Some(unknown) = map.keys().find(|k| !TOP_LEVEL_FIELDS.contains(&k.as_str())) {
        return Err(field(unknown, "unknown field"));
    }
    match map.get("apiVersion").and_then(|v| v.as_str()) {
        Some(API_VERSION) => {}
        Some(other) => {
            return Err(field(
                "apiVersion",
                &format!("must be {API_VERSION}, not {other}"),
            ))
        }
        None => return Err(field("apiVersion", &format!("is required ({API_VERSION})"))),
    }
    match map.get("kind").and_then(|v| v.as_str()) {
        Some(KIND) => Ok(()),
        Some(other) => Err(field("kind", &format!("must be {KIND}, not {other}"))),
        None => Err(field("kind", &format!("is required ({KIND})"))),
    }
}

/// The checks serde cannot express: the CRD's schema (bounds, patterns, enums, required fields)
/// and its CEL rules (cross-field rules, URLs), exactly as the API server applies them to a new
/// object (see [`crate::api::rules`]). Returns every problem, not just the first; the messages
/// never repeat a URL (it may hold a password).
pub fn validate_spec(spec: &DlqReplaySpec) -> Vec<FieldError> {
    let spec = match serde_json::to_value(spec) {
        Ok(v) => v,
        Err(e) => return vec![err("spec", &e.to_string())],
    };
    let obj = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "manifest"},
        "spec": spec,
    });
    crd_schema()
        .validate(&obj, None)
        .into_iter()
        .map(|v| FieldError {
            path: v.field,
            message: v.message,
        })
        .collect()
}

/// Check a URL given outside the manifest (`--amqp-url`, a Secret's value) by the same rule as
/// an inline `url` of the spec ([`crate::api::url_rule`]); the message never repeats the URL
/// (it may hold a password).
pub fn check_url(u: &str, schemes: &[&str]) -> Result<(), String> {
    let (rule, message) = crate::api::url_rule(schemes);
    let schema = serde_json::json!({"type": "object", "properties": {"url": {"type": "string"}}});
    match structural::eval_rule(&rule, &schema, &serde_json::json!({ "url": u })) {
        Ok(true) => Ok(()),
        Ok(false) => Err(message),
        Err(e) => Err(format!("cannot check the URL: {e}")),
    }
}

fn err(path: &str, message: &str) -> FieldError {
    FieldError {
        path: path.into(),
        message: message.into(),
    }
}

fn field(path: &str, message: &str) -> ManifestError {
    ManifestError::Field {
        path: path.into(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
apiVersion: replay.dlq.dev/v1alpha1
kind: DlqReplay
metadata: {name: r1, namespace: media}
spec:
  broker: {url: "amqp://guest:guest@127.0.0.1:5672/%2f"}
  source: {queue: media.dlq}
  quarantine: {queue: media.quarantine}
"#;

    #[test]
    fn a_minimal_manifest_parses_with_defaults() {
        let r = parse(GOOD).expect("valid");
        assert_eq!(r.spec.source.queue, "media.dlq");
        assert!(r.spec.canary.enabled);
        assert_eq!(r.spec.canary.wait_seconds, 120);
        assert!(r.spec.rate.is_none());
    }

    #[test]
    fn unknown_spec_field_is_named() {
        let text = GOOD.replace(
            "source: {queue: media.dlq}",
            "source: {queue: media.dlq, qeue: x}",
        );
        let e = parse(&text).unwrap_err().to_string();
        assert!(e.starts_with("spec.source"), "{e}");
        assert!(e.contains("qeue"), "{e}");
    }

    #[test]
    fn zero_rate_is_refused_with_its_path() {
        let text = format!("{GOOD}  rate: {{messagesPerSecond: 0}}\n");
        let e = parse(&text).unwrap_err().to_string();
        assert!(e.contains("spec.rate.messagesPerSecond"), "{e}");
    }

    #[test]
    fn url_errors_do_not_echo_the_password() {
        let text = GOOD.replace("amqp://guest:guest@", "http://guest:s3cr3t@");
        let e = parse(&text).unwrap_err().to_string();
        assert!(e.contains("spec.broker.url"), "{e}");
        assert!(!e.contains("s3cr3t"), "{e}");
    }

    #[test]
    fn a_clustered_server_is_named_by_its_endpoints() {
        let amqp = &crate::api::AMQP_SCHEMES;
        let redis = &crate::api::REDIS_SCHEMES;
        for good in [
            "amqp://u:p@a:5681,b:5682,c:5683/%2f",
            "amqp://u:p@a:5681/%2f,amqps://u:p@b:5671/prod",
            "amqp://a,b",
        ] {
            assert_eq!(check_url(good, amqp), Ok(()), "{good}");
        }
        for good in [
            "redis+sentinel://s1:26379,s2:26379,s3:26379/mymaster",
            "rediss+cluster://u:p@n1:7000,n2:7001",
            "redis://h:6379/0",
        ] {
            assert_eq!(check_url(good, redis), Ok(()), "{good}");
        }
        for bad in [
            "a:5681,amqp://b:5682/%2f",
            "amqp://a:5681,b:99999999/%2f",
            "amqp://a:5681,http://b/",
            "amqp://a:5681,,b",
            "amqp://a:5681, b",
        ] {
            assert!(check_url(bad, amqp).is_err(), "{bad}");
        }
        assert!(check_url("redis+sentinel://s1:26379/m", amqp).is_err());
    }
}
