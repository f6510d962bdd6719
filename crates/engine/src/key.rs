//! Idempotency key derivation: `prefix` + first 32 hex chars of sha256(values joined by ":").
//!
//! Pure, so the operator, the CLI, the benchmark and the workers' own tooling agree on a key.

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::spec::KeySpec;

/// Why no key could be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// A field without default is absent from the body.
    #[error("idempotency key field {0} is missing and has no default")]
    Missing(String),
}

/// Derive the key of a JSON body.
pub fn derive(spec: &KeySpec, body: &Value) -> Result<String, KeyError> {
    let mut joined = String::new();
    for (i, field) in spec.fields.iter().enumerate() {
        let value = match body.pointer(&field.pointer).and_then(field_text) {
            Some(v) => v,
            None => field
                .default
                .clone()
                .ok_or_else(|| KeyError::Missing(field.pointer.clone()))?,
        };
        if i > 0 {
            joined.push(':');
        }
        joined.push_str(&value);
    }
    Ok(key_of(&spec.prefix, &joined))
}

/// The key of an already-joined value string.
pub fn key_of(prefix: &str, joined: &str) -> String {
    let digest = hex::encode(Sha256::digest(joined.as_bytes()));
    format!("{prefix}{}", &digest[..32])
}

/// A field's text: strings by their content, numbers and booleans by their JSON form, objects
/// and arrays by their compact JSON. `null` counts as missing, so its default applies.
pub fn field_text(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::KeyField;
    use serde_json::json;

    fn spec() -> KeySpec {
        let f = |p: &str, d: Option<&str>| KeyField {
            pointer: p.into(),
            default: d.map(Into::into),
        };
        KeySpec {
            fields: vec![
                f("/asset_id", None),
                f("/stage", None),
                f("/version", Some("1")),
            ],
            prefix: "idem:".into(),
        }
    }

    #[test]
    fn matches_the_documented_example() {
        let body = json!({"asset_id": "ep214", "stage": "rss_publish"});
        let expected = format!(
            "idem:{}",
            &hex::encode(Sha256::digest(b"ep214:rss_publish:1"))[..32]
        );
        assert_eq!(derive(&spec(), &body).unwrap(), expected);
    }

    #[test]
    fn numbers_and_explicit_values_count() {
        let a = derive(&spec(), &json!({"asset_id": 7, "stage": "s", "version": 2})).unwrap();
        assert_eq!(a, key_of("idem:", "7:s:2"));
    }

    #[test]
    fn missing_field_without_default_is_an_error() {
        let e = derive(&spec(), &json!({"asset_id": "x"})).unwrap_err();
        assert_eq!(e, KeyError::Missing("/stage".into()));
    }
}
