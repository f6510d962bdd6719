//! Reading a `DlqReplay` manifest and refusing bad ones before anything touches the broker.
//!
//! Every error names the field it is about (`spec.rate.messagesPerSecond: ...`), because the
//! person reading it is holding a YAML file, not our Rust types.

use crate::api::{ConnectionSpec, DlqReplay, DlqReplaySpec, API_VERSION, KIND};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};

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
    check_no_list_for_map(&value, &schema(), "")?;
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
pub fn load(path: &str) -> Result<DlqReplay, crate::Error> {
    let text = if path == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|e| crate::Error::Io(format!("cannot read {path}: {e}")))?;
    parse(&text).map_err(|e| crate::Error::Manifest(format!("{path}: {e}")))
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

/// The resource's structural schema, as the API server sees it.
fn schema() -> JSONSchemaProps {
    let crd = <crate::api::DlqReplay as kube::CustomResourceExt>::crd();
    crd.spec
        .versions
        .into_iter()
        .next()
        .and_then(|v| v.schema)
        .and_then(|s| s.open_api_v3_schema)
        .unwrap_or_default()
}

/// serde lets a struct be written as the list of its fields in order (`source: [media.dlq]`);
/// the API server does not, so neither do we: a list where the schema has an object is refused.
fn check_no_list_for_map(
    value: &serde_json::Value,
    schema: &JSONSchemaProps,
    path: &str,
) -> Result<(), ManifestError> {
    match value {
        serde_json::Value::Array(items) => {
            if schema.type_.as_deref() == Some("object") {
                return Err(field(path, "invalid type: sequence, expected a map"));
            }
            if let Some(JSONSchemaPropsOrArray::Schema(item)) = &schema.items {
                for (i, v) in items.iter().enumerate() {
                    check_no_list_for_map(v, item, &format!("{path}[{i}]"))?;
                }
            }
        }
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let sub = schema.properties.as_ref().and_then(|p| p.get(k));
                let sub = sub.or(match &schema.additional_properties {
                    Some(JSONSchemaPropsOrBool::Schema(s)) => Some(&**s),
                    _ => None,
                });
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

/// The semantic checks serde cannot express. Returns every problem, not just the first.
pub fn validate_spec(spec: &DlqReplaySpec) -> Vec<FieldError> {
    let mut errors = Vec::new();
    check_connection(&mut errors, "spec.broker", &spec.broker, &["amqp", "amqps"]);
    if spec.source.queue.is_empty() {
        errors.push(err("spec.source.queue", "must not be empty"));
    }
    if spec.quarantine.queue.is_empty() {
        errors.push(err("spec.quarantine.queue", "must not be empty"));
    }
    if spec.quarantine.queue == spec.source.queue {
        errors.push(err(
            "spec.quarantine.queue",
            "must differ from spec.source.queue",
        ));
    }
    if spec.selector.limit == Some(0) {
        errors.push(err(
            "spec.selector.limit",
            "must be at least 1 (omit it for no limit)",
        ));
    }
    for (i, m) in spec.selector.payload.iter().enumerate() {
        let path = format!("spec.selector.payload[{i}]");
        check_pointer(&mut errors, &format!("{path}.pointer"), &m.pointer);
        if m.equals.is_none() && m.in_.is_none() {
            errors.push(err(&path, "needs `equals` or `in`"));
        }
        if m.in_.as_ref().is_some_and(Vec::is_empty) {
            errors.push(err(&format!("{path}.in"), "must not be empty"));
        }
    }
    for (i, p) in spec.poison.required_fields.iter().enumerate() {
        check_pointer(&mut errors, &format!("spec.poison.requiredFields[{i}]"), p);
    }
    for (i, p) in spec.poison.json_fields.iter().enumerate() {
        check_pointer(&mut errors, &format!("spec.poison.jsonFields[{i}]"), p);
    }
    if let Some(r) = spec.poison.max_quarantine_ratio {
        if !(0.0..=1.0).contains(&r) {
            errors.push(err(
                "spec.poison.maxQuarantineRatio",
                "must be between 0 and 1",
            ));
        }
    }
    if let Some(idem) = &spec.idempotency {
        if let Some(redis) = &idem.redis {
            check_connection(
                &mut errors,
                "spec.idempotency.redis",
                redis,
                &["redis", "rediss"],
            );
        }
        if idem.key.fields.is_empty() {
            errors.push(err(
                "spec.idempotency.key.fields",
                "needs at least one field",
            ));
        }
        for (i, f) in idem.key.fields.iter().enumerate() {
            check_pointer(
                &mut errors,
                &format!("spec.idempotency.key.fields[{i}].pointer"),
                &f.pointer,
            );
        }
        if idem.done_value.is_empty() {
            errors.push(err("spec.idempotency.doneValue", "must not be empty"));
        }
        if idem.ttl_seconds == 0 {
            errors.push(err("spec.idempotency.ttlSeconds", "must be at least 1"));
        }
    }
    if let Some(audit) = &spec.audit {
        check_connection(
            &mut errors,
            "spec.audit.redis",
            &audit.redis,
            &["redis", "rediss"],
        );
    }
    if let Some(rate) = &spec.rate {
        if rate.messages_per_second == 0 {
            errors.push(err(
                "spec.rate.messagesPerSecond",
                "must be at least 1 (omit spec.rate for no limit)",
            ));
        }
        if rate.burst == Some(0) {
            errors.push(err("spec.rate.burst", "must be at least 1"));
        }
    }
    let canary = &spec.canary;
    if !(5..=1800).contains(&canary.wait_seconds) {
        errors.push(err("spec.canary.waitSeconds", "must be between 5 and 1800"));
    }
    if !(0.0..=1.0).contains(&canary.max_return_ratio) {
        errors.push(err("spec.canary.maxReturnRatio", "must be between 0 and 1"));
    }
    if !(1..=1000).contains(&canary.max_signatures) {
        errors.push(err(
            "spec.canary.maxSignatures",
            "must be between 1 and 1000",
        ));
    }
    if canary.signature_header.is_empty() {
        errors.push(err("spec.canary.signatureHeader", "must not be empty"));
    }
    if canary.require_done
        && spec.idempotency.as_ref().map(|i| i.mode) != Some(crate::api::IdempotencyMode::Check)
    {
        errors.push(err(
            "spec.canary.requireDone",
            "needs spec.idempotency.mode: Check",
        ));
    }
    errors
}

fn check_connection(
    errors: &mut Vec<FieldError>,
    path: &str,
    c: &ConnectionSpec,
    schemes: &[&str],
) {
    match (&c.url, &c.url_secret_ref) {
        (Some(_), Some(_)) => errors.push(err(path, "give either url or urlSecretRef, not both")),
        (Some(u), None) => {
            if let Err(message) = check_url(u, schemes) {
                errors.push(err(&format!("{path}.url"), &message));
            }
        }
        (None, Some(s)) => {
            if s.name.is_empty() {
                errors.push(err(
                    &format!("{path}.urlSecretRef.name"),
                    "must not be empty",
                ));
            }
            if s.key.is_empty() {
                errors.push(err(
                    &format!("{path}.urlSecretRef.key"),
                    "must not be empty",
                ));
            }
        }
        (None, None) => {}
    }
}

/// Check a URL's scheme and shape; the message never repeats the URL (it may hold a password).
pub fn check_url(u: &str, schemes: &[&str]) -> Result<(), String> {
    let parsed = url::Url::parse(u).map_err(|e| format!("not a valid URL ({e})"))?;
    if !schemes.contains(&parsed.scheme()) {
        return Err(format!(
            "scheme must be one of {}, not {}",
            schemes.join(", "),
            parsed.scheme()
        ));
    }
    if parsed.host_str().unwrap_or("").is_empty() {
        return Err("has no host".into());
    }
    Ok(())
}

fn check_pointer(errors: &mut Vec<FieldError>, path: &str, pointer: &str) {
    if !pointer.starts_with('/') {
        errors.push(err(
            path,
            "must be a JSON pointer starting with '/' (RFC 6901)",
        ));
    } else if has_bad_escape(pointer) {
        errors.push(err(path, "has '~' not followed by 0 or 1 (RFC 6901)"));
    }
}

fn has_bad_escape(pointer: &str) -> bool {
    let bytes = pointer.as_bytes();
    bytes
        .iter()
        .enumerate()
        .any(|(i, b)| *b == b'~' && !matches!(bytes.get(i + 1), Some(b'0') | Some(b'1')))
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
}
