//! What a violation says (as kube-apiserver writes it), and which ones an update keeps
//! (ratcheting).

use jsonschema::error::{TypeKind, ValidationErrorKind};
use jsonschema::paths::LocationSegment;
use serde_json::Value;

use super::prune::join;
use super::Violation;

/// A path (`spec.selector.payload[0].pointer`) as its segments.
pub(super) enum Seg {
    Key(String),
    Index(usize),
}

pub(super) fn parse_path(path: &str) -> Vec<Seg> {
    let mut out = Vec::new();
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (name, mut rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !name.is_empty() {
            out.push(Seg::Key(name.to_string()));
        }
        while let Some(end) = rest.find(']') {
            if let Ok(i) = rest[1..end].parse() {
                out.push(Seg::Index(i));
            }
            rest = &rest[end + 1..];
        }
    }
    out
}

/// The value at `path`, or `None`.
pub(super) fn value_at<'a>(value: &'a Value, path: &[Seg]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, seg| match seg {
        Seg::Key(k) => v.get(k),
        Seg::Index(i) => v.get(*i),
    })
}

/// Drops what an update did not change (ratcheting): a violation whose node has the same value
/// in the stored object. The items of a list are compared as the whole list (they have no
/// identity of their own in an atomic list).
pub(super) fn ratchet(found: &mut Vec<Violation>, obj: &Value, old: Option<&Value>) {
    let Some(old) = old else {
        return;
    };
    found.retain(|v| {
        if v.transition {
            return true;
        }
        let mut path = parse_path(&v.node);
        if let Some(first_index) = path.iter().position(|s| matches!(s, Seg::Index(_))) {
            path.truncate(first_index);
        }
        match (value_at(obj, &path), value_at(old, &path)) {
            (Some(a), Some(b)) => a != b,
            _ => true,
        }
    });
}

/// How kube-apiserver prints a value in `Invalid value: ...`.
pub(super) fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Object(_) => "\"object\"".into(),
        Value::Array(_) => "\"array\"".into(),
        Value::Null => "\"null\"".into(),
        other => other.to_string(),
    }
}

pub(super) fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

pub(super) fn number(v: &Value) -> String {
    match v.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
        _ => v.to_string(),
    }
}

/// A jsonschema error as kube-apiserver's (kube-openapi's) field error.
pub(super) fn schema_violation(e: &jsonschema::ValidationError<'_>) -> Violation {
    let mut path = String::new();
    for seg in e.instance_path().segments() {
        match seg {
            LocationSegment::Property(p) => path = join(&path, &p),
            LocationSegment::Index(i) => path = format!("{path}[{i}]"),
        }
    }
    let value = e.instance();
    let node = path.clone();
    let in_body = |what: String| (format!("{path} in body {what}"), what);
    let (field, reason, detail, message) = match e.kind() {
        ValidationErrorKind::Required { property } => {
            let name = property.as_str().unwrap_or_default();
            (
                join(&path, name),
                "FieldValueRequired",
                "Required value".to_string(),
                "Required value".to_string(),
            )
        }
        ValidationErrorKind::Type { kind } => {
            let expected = match kind {
                TypeKind::Single(t) => t.to_string(),
                TypeKind::Multiple(set) => set
                    .iter()
                    .map(|t| t.to_string())
                    .filter(|t| t != "null")
                    .collect::<Vec<_>>()
                    .join(","),
            };
            let actual = json_type(value);
            let (long, short) = in_body(format!("must be of type {expected}: \"{actual}\""));
            (
                path.clone(),
                "FieldValueTypeInvalid",
                format!("Invalid value: \"{actual}\": {long}"),
                format!("Invalid value: \"{actual}\": {short}"),
            )
        }
        ValidationErrorKind::Enum { options } => {
            let supported = options
                .as_array()
                .map(|o| {
                    o.iter()
                        .filter(|v| !v.is_null())
                        .map(shown)
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default();
            let text = format!(
                "Unsupported value: {}: supported values: {supported}",
                shown(value)
            );
            (path.clone(), "FieldValueNotSupported", text.clone(), text)
        }
        ValidationErrorKind::Minimum { limit } => invalid(
            &path,
            value,
            in_body(format!(
                "should be greater than or equal to {}",
                number(limit)
            )),
        ),
        ValidationErrorKind::Maximum { limit } => invalid(
            &path,
            value,
            in_body(format!("should be less than or equal to {}", number(limit))),
        ),
        ValidationErrorKind::ExclusiveMinimum { limit } => invalid(
            &path,
            value,
            in_body(format!("should be greater than {}", number(limit))),
        ),
        ValidationErrorKind::ExclusiveMaximum { limit } => invalid(
            &path,
            value,
            in_body(format!("should be less than {}", number(limit))),
        ),
        ValidationErrorKind::MinLength { limit } => invalid(
            &path,
            value,
            in_body(format!("should be at least {limit} chars long")),
        ),
        ValidationErrorKind::MaxLength { limit } => {
            // Never repeats the value: it may be a URL with a password.
            let text = format!("Too long: may not be more than {limit} bytes");
            (path.clone(), "FieldValueTooLong", text.clone(), text)
        }
        ValidationErrorKind::MinItems { limit } => {
            let n = value.as_array().map_or(0, Vec::len);
            let (long, short) = in_body(format!("should have at least {limit} items"));
            (
                path.clone(),
                "FieldValueInvalid",
                format!("Invalid value: {n}: {long}"),
                format!("Invalid value: {n}: {short}"),
            )
        }
        ValidationErrorKind::MaxItems { limit } => {
            let n = value.as_array().map_or(0, Vec::len);
            let text = format!("Too many: {n}: must have at most {limit} items");
            (path.clone(), "FieldValueTooMany", text.clone(), text)
        }
        ValidationErrorKind::Pattern { pattern } => {
            invalid(&path, value, in_body(format!("should match '{pattern}'")))
        }
        other => {
            let (long, short) = in_body(format!("fails {}", other.keyword()));
            (
                path.clone(),
                "FieldValueInvalid",
                format!("Invalid value: {}: {long}", shown(value)),
                format!("Invalid value: {}: {short}", shown(value)),
            )
        }
    };
    Violation {
        field: if field.is_empty() {
            "<nil>".into()
        } else {
            field
        },
        reason,
        detail,
        message,
        node,
        transition: false,
    }
}

pub(super) fn invalid(
    path: &str,
    value: &Value,
    (long, short): (String, String),
) -> (String, &'static str, String, String) {
    let shown = match value {
        Value::Number(_) => number(value),
        other => shown(other),
    };
    (
        path.to_string(),
        "FieldValueInvalid",
        format!("Invalid value: {shown}: {long}"),
        format!("Invalid value: {shown}: {short}"),
    )
}
