//! What kube-apiserver does to a custom resource with a structural schema, before it stores it:
//! prune unknown fields, default, validate against the OpenAPI v3 schema, evaluate the CEL rules
//! (`x-kubernetes-validations`, transition rules with `oldSelf` included), and, on an update,
//! let unchanged parts that fail pass (validation ratcheting, GA in 1.33).
//!
//! One engine serves both sides of the same rules: the command line validates a manifest with
//! it ([`super::validate_spec`], against [`crate::api::crd`]), and the in-process fake API server
//! of the tests validates every write with it, against the committed `crds/dlqreplay.yaml`. The
//! schema part is checked by the `jsonschema` crate (draft 4, the JSON Schema of OpenAPI v3.0,
//! with `nullable` as kube-apiserver reads it), the CEL part by `kube-cel` (the `cel` crate plus
//! the Kubernetes CEL libraries). Errors read as kube-apiserver writes them
//! (`spec.rate.messagesPerSecond: Invalid value: 0: spec.rate.messagesPerSecond in body should be
//! greater than or equal to 1`) and never repeat a string a CEL rule is about (a URL may hold a
//! password).

use std::collections::HashMap;

use jsonschema::error::{TypeKind, ValidationErrorKind};
use jsonschema::paths::LocationSegment;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Map, Value};

/// One refused field, as kube-apiserver reports it (a `Status` cause).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The field, e.g. `spec.rate.messagesPerSecond` or `spec.selector.payload[0].pointer`.
    pub field: String,
    /// `FieldValueInvalid`, `FieldValueRequired`, `FieldValueNotSupported`,
    /// `FieldValueTypeInvalid`, `FieldValueForbidden`, `FieldValueTooLong`, `FieldValueTooMany`.
    pub reason: &'static str,
    /// kube-apiserver's text after the field, e.g. `Invalid value: 0: spec.rate.messagesPerSecond
    /// in body should be greater than or equal to 1` (a cause's `message`).
    pub detail: String,
    /// The same for a person holding the manifest, without the repeated path, e.g.
    /// `Invalid value: 0: should be greater than or equal to 1`.
    pub message: String,
    /// The schema node whose value failed (the rule's `self`); an update that leaves it as it
    /// was is not refused for it (ratcheting).
    node: String,
    /// A transition rule: never ratcheted.
    transition: bool,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.detail)
    }
}

/// The structural schema of one version of a CRD, ready to prune, default and validate objects.
pub struct CrdSchema {
    /// `openAPIV3Schema`, as JSON.
    schema: Value,
    json_schema: jsonschema::Validator,
    cel: kube_cel::CompiledSchema,
    cel_validator: kube_cel::Validator,
    /// The `fieldPath` of each CEL rule, by its expression (to find the rule's node again).
    field_paths: HashMap<String, Option<String>>,
}

impl std::fmt::Debug for CrdSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrdSchema").finish_non_exhaustive()
    }
}

impl CrdSchema {
    /// The schema of `version` of `crd`.
    pub fn new(crd: &CustomResourceDefinition, version: &str) -> Result<Self, String> {
        let v = crd
            .spec
            .versions
            .iter()
            .find(|v| v.name == version)
            .ok_or_else(|| format!("the CRD has no version {version}"))?;
        let schema = v
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .ok_or_else(|| format!("version {version} has no openAPIV3Schema"))?;
        Self::from_json(serde_json::to_value(schema).map_err(|e| e.to_string())?)
    }

    /// From an `openAPIV3Schema` as JSON.
    pub fn from_json(schema: Value) -> Result<Self, String> {
        let json_schema = jsonschema::draft4::options()
            .should_validate_formats(false)
            .build(&to_json_schema(&schema))
            .map_err(|e| format!("the schema is not a valid JSON schema: {e}"))?;
        let cel = kube_cel::compile_schema(&schema);
        let mut field_paths = HashMap::new();
        collect_rules(&schema, &mut field_paths);
        let mut problems = Vec::new();
        cel_compilation_errors(&cel, &mut problems);
        if !problems.is_empty() {
            return Err(format!(
                "the schema has CEL rules that do not compile: {}",
                problems.join("; ")
            ));
        }
        Ok(Self {
            schema,
            json_schema,
            cel,
            cel_validator: kube_cel::Validator::new(),
            field_paths,
        })
    }

    /// The `openAPIV3Schema`, as JSON.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// Pruning, as kube-apiserver does on every write: removes the fields the schema does not
    /// know (not `apiVersion`, `kind` and `metadata` at the root; not under
    /// `x-kubernetes-preserve-unknown-fields`) and the nulls of fields that are not `nullable`.
    /// Returns the paths of the unknown fields removed (`spec.foo`), for a warning or, with
    /// `fieldValidation=Strict`, a refusal.
    pub fn prune(&self, obj: &mut Value) -> Vec<String> {
        let mut unknown = Vec::new();
        if let Value::Object(map) = obj {
            prune_object(map, &self.schema, "", true, &mut unknown);
        }
        unknown
    }

    /// Defaulting: fills the schema's `default`s in where a field is absent.
    pub fn default(&self, obj: &mut Value) {
        *obj = kube_cel::apply_defaults(&self.schema, obj);
    }

    /// Validation of a whole object (pruned and defaulted): the schema, then the CEL rules
    /// (skipped, as by kube-apiserver, when a schema error is one of [`BLOCKING`]). `old` is the stored
    /// object of an update: transition rules are evaluated against it, and what failed but did
    /// not change passes (ratcheting).
    pub fn validate(&self, obj: &Value, old: Option<&Value>) -> Vec<Violation> {
        let mut found: Vec<Violation> = self
            .json_schema
            .iter_errors(obj)
            .map(|e| schema_violation(&e))
            .collect();
        ratchet(&mut found, obj, old);
        if found.iter().any(|v| BLOCKING.contains(&v.reason)) {
            found.push(Violation {
                field: "<nil>".into(),
                reason: "FieldValueInvalid",
                detail: "Invalid value: null: some validation rules were not checked because the object was invalid; correct the existing errors to complete validation".into(),
                message: "some validation rules were not checked because the object was invalid; correct the existing errors to complete validation".into(),
                node: String::new(),
                transition: false,
            });
            return found;
        }
        let new = without_nulls(obj);
        let old_value = old.map(without_nulls);
        let mut cel = Vec::new();
        if let Err(errors) =
            self.cel_validator
                .validate_compiled(&self.cel, &new, old_value.as_ref())
        {
            for e in errors.iter() {
                cel.push(self.cel_violation(e));
            }
        }
        ratchet(&mut cel, obj, old);
        found.extend(cel);
        found
    }

    fn cel_violation(&self, e: &kube_cel::ValidationError) -> Violation {
        let field_path = self.field_paths.get(&e.rule).cloned().flatten();
        let node = field_path
            .as_deref()
            .and_then(|fp| e.field_path.strip_suffix(fp))
            .unwrap_or(&e.field_path)
            .to_string();
        let failed = matches!(e.kind, kube_cel::ErrorKind::ValidationFailure);
        let reason = match e.reason.as_deref() {
            Some("FieldValueForbidden") if failed => "FieldValueForbidden",
            Some("FieldValueRequired") if failed => "FieldValueRequired",
            _ => "FieldValueInvalid",
        };
        let detail = match reason {
            "FieldValueForbidden" => format!("Forbidden: {}", e.message),
            "FieldValueRequired" => format!("Required value: {}", e.message),
            // kube-apiserver v1.36 names no value for a failed rule (earlier ones wrote the
            // node's type, `Invalid value: "object": ...`).
            _ => format!("Invalid value: {}", e.message),
        };
        Violation {
            field: if e.field_path.is_empty() {
                "<nil>".into()
            } else {
                e.field_path.clone()
            },
            reason,
            detail,
            message: e.message.clone(),
            node,
            transition: e.rule.contains("oldSelf"),
        }
    }
}

/// The reasons of the schema errors that keep kube-apiserver (v1.36) from evaluating the CEL
/// rules (`hasBlockingErr` of apiextensions-apiserver's `pkg/registry/customresource`): it then
/// adds one `<nil>` cause saying some rules were not checked.
pub const BLOCKING: &[&str] = &[
    "FieldValueNotSupported",
    "FieldValueRequired",
    "FieldValueTooLong",
    "FieldValueTooMany",
    "FieldValueTypeInvalid",
];

/// Evaluates one CEL rule with `self` bound to `value` (schema: `self_schema`), in the same
/// environment as the rules of a CRD: `Ok(true)` when it holds.
pub fn eval_rule(rule: &str, self_schema: &Value, value: &Value) -> Result<bool, String> {
    let mut schema = self_schema.clone();
    schema["x-kubernetes-validations"] = serde_json::json!([{"rule": rule}]);
    match kube_cel::validate(&schema, value, None) {
        Ok(()) => Ok(true),
        Err(errors) => match errors
            .iter()
            .find(|e| e.kind != kube_cel::ErrorKind::ValidationFailure)
        {
            Some(e) => Err(e.message.clone()),
            None => Ok(false),
        },
    }
}

/// The `rule → fieldPath` of every CEL rule of the schema.
fn collect_rules(schema: &Value, out: &mut HashMap<String, Option<String>>) {
    if let Some(rules) = schema
        .get("x-kubernetes-validations")
        .and_then(Value::as_array)
    {
        for r in rules {
            if let Some(rule) = r.get("rule").and_then(Value::as_str) {
                let fp = r
                    .get("fieldPath")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                out.insert(rule.to_string(), fp);
            }
        }
    }
    for_each_subschema(schema, |s| collect_rules(s, out));
}

fn cel_compilation_errors(c: &kube_cel::CompiledSchema, out: &mut Vec<String>) {
    out.extend(c.compilation_errors().iter().map(|e| e.to_string()));
    for child in c.properties.values() {
        cel_compilation_errors(child, out);
    }
    for child in c.items.iter().chain(c.additional_properties.iter()) {
        cel_compilation_errors(child, out);
    }
}

fn for_each_subschema(schema: &Value, mut f: impl FnMut(&Value)) {
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        props.values().for_each(&mut f);
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(s) = schema.get(key).filter(|s| s.is_object()) {
            f(s);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(list) = schema.get(key).and_then(Value::as_array) {
            list.iter().for_each(&mut f);
        }
    }
}

/// The OpenAPI v3.0 schema as a JSON Schema (draft 4): `nullable: true` becomes a `null` type
/// (and enum value), and the Kubernetes extensions go (the CEL rules are kube-cel's part).
fn to_json_schema(schema: &Value) -> Value {
    let Value::Object(map) = schema else {
        return schema.clone();
    };
    let mut out = Map::new();
    let nullable = map.get("nullable").and_then(Value::as_bool) == Some(true);
    for (k, v) in map {
        let v = match k.as_str() {
            "nullable" | "x-kubernetes-validations" | "default" => continue,
            "properties" => Value::Object(
                v.as_object()
                    .map(|p| {
                        p.iter()
                            .map(|(n, s)| (n.clone(), to_json_schema(s)))
                            .collect()
                    })
                    .unwrap_or_default(),
            ),
            "items" | "additionalProperties" | "not" => to_json_schema(v),
            "allOf" | "anyOf" | "oneOf" => Value::Array(
                v.as_array()
                    .map(|l| l.iter().map(to_json_schema).collect())
                    .unwrap_or_default(),
            ),
            "type" if nullable => serde_json::json!([v, "null"]),
            "enum" if nullable => {
                let mut values = v.as_array().cloned().unwrap_or_default();
                values.push(Value::Null);
                Value::Array(values)
            }
            _ => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    Value::Object(out)
}

fn preserves_unknown(schema: &Value) -> bool {
    schema
        .get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        == Some(true)
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn prune_object(
    map: &mut Map<String, Value>,
    schema: &Value,
    path: &str,
    root: bool,
    unknown: &mut Vec<String>,
) {
    let props = schema.get("properties").and_then(Value::as_object);
    let additional = schema.get("additionalProperties").filter(|a| a.is_object());
    let keep_unknown =
        preserves_unknown(schema) || schema.get("additionalProperties") == Some(&Value::Bool(true));
    let keys: Vec<String> = map.keys().cloned().collect();
    for key in keys {
        if root && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        let sub = props.and_then(|p| p.get(&key)).or(additional);
        let Some(sub) = sub else {
            if !keep_unknown {
                map.remove(&key);
                unknown.push(join(path, &key));
            }
            continue;
        };
        let child_path = join(path, &key);
        let value = map.get_mut(&key).expect("key from the map");
        if value.is_null() {
            if sub.get("nullable").and_then(Value::as_bool) != Some(true) {
                map.remove(&key);
            }
            continue;
        }
        prune_value(value, sub, &child_path, unknown);
    }
}

fn prune_value(value: &mut Value, schema: &Value, path: &str, unknown: &mut Vec<String>) {
    match value {
        Value::Object(map) => prune_object(map, schema, path, false, unknown),
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items").filter(|s| s.is_object()) {
                for (i, item) in items.iter_mut().enumerate() {
                    prune_value(item, item_schema, &format!("{path}[{i}]"), unknown);
                }
            }
        }
        _ => {}
    }
}

/// The value with every null object field removed: CEL sees a null field as absent.
fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

/// A path (`spec.selector.payload[0].pointer`) as its segments.
enum Seg {
    Key(String),
    Index(usize),
}

fn parse_path(path: &str) -> Vec<Seg> {
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
fn value_at<'a>(value: &'a Value, path: &[Seg]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, seg| match seg {
        Seg::Key(k) => v.get(k),
        Seg::Index(i) => v.get(*i),
    })
}

/// Drops what an update did not change (ratcheting): a violation whose node has the same value
/// in the stored object. The items of a list are compared as the whole list (they have no
/// identity of their own in an atomic list).
fn ratchet(found: &mut Vec<Violation>, obj: &Value, old: Option<&Value>) {
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
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Object(_) => "\"object\"".into(),
        Value::Array(_) => "\"array\"".into(),
        Value::Null => "\"null\"".into(),
        other => other.to_string(),
    }
}

fn json_type(v: &Value) -> &'static str {
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

fn number(v: &Value) -> String {
    match v.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
        _ => v.to_string(),
    }
}

/// A jsonschema error as kube-apiserver's (kube-openapi's) field error.
fn schema_violation(e: &jsonschema::ValidationError<'_>) -> Violation {
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

fn invalid(
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> CrdSchema {
        CrdSchema::from_json(json!({
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "required": ["n"],
                    "properties": {
                        "n": {"type": "integer", "minimum": 1},
                        "s": {"type": "string", "nullable": true, "maxLength": 3},
                        "keep": {"type": "boolean", "default": true},
                        "list": {"type": "array", "maxItems": 2, "items": {"type": "string", "pattern": "^/"}},
                    },
                    "x-kubernetes-validations": [
                        {"rule": "!has(self.s) || self.s != 'no'", "fieldPath": ".s", "message": "not no"},
                        {"rule": "self.n == oldSelf.n", "fieldPath": ".n", "message": "is immutable", "reason": "FieldValueForbidden"},
                    ],
                },
            },
        }))
        .expect("schema")
    }

    fn fields(v: &[Violation]) -> Vec<String> {
        v.iter()
            .map(|v| format!("{}|{}", v.field, v.reason))
            .collect()
    }

    #[test]
    fn prunes_unknown_fields_and_non_nullable_nulls_then_defaults() {
        let s = schema();
        let mut obj = json!({"apiVersion": "x/v1", "kind": "X", "metadata": {"name": "a"},
            "spec": {"n": 1, "s": null, "keep": null, "extra": 1}, "other": {}});
        let unknown = s.prune(&mut obj);
        assert_eq!(unknown, ["other", "spec.extra"]);
        s.default(&mut obj);
        assert_eq!(obj["spec"], json!({"n": 1, "s": null, "keep": true}));
        assert_eq!(obj["metadata"]["name"], "a");
        assert!(
            s.validate(&obj, None).is_empty(),
            "{:?}",
            s.validate(&obj, None)
        );
    }

    #[test]
    fn schema_errors_read_as_kube_apiserver_writes_them() {
        let s = schema();
        let v = s.validate(
            &json!({"spec": {"n": 0, "s": "long", "list": ["a", "/b", "/c"]}}),
            None,
        );
        assert_eq!(
            fields(&v),
            [
                "spec.list|FieldValueTooMany",
                "spec.list[0]|FieldValueInvalid",
                "spec.n|FieldValueInvalid",
                "spec.s|FieldValueTooLong",
                // TooMany and TooLong keep kube-apiserver from the CEL rules, and it says so.
                "<nil>|FieldValueInvalid",
            ]
        );
        assert_eq!(
            v[1].detail,
            "Invalid value: \"a\": spec.list[0] in body should match '^/'"
        );
        assert_eq!(
            v[2].detail,
            "Invalid value: 0: spec.n in body should be greater than or equal to 1"
        );
        assert_eq!(
            v[2].message,
            "Invalid value: 0: should be greater than or equal to 1"
        );
        let v = s.validate(&json!({"spec": {}}), None);
        assert_eq!(
            fields(&v),
            ["spec.n|FieldValueRequired", "<nil>|FieldValueInvalid"]
        );
        assert_eq!(
            v[1].detail,
            "Invalid value: null: some validation rules were not checked because the object was invalid; correct the existing errors to complete validation"
        );
    }

    #[test]
    fn a_type_error_skips_the_cel_rules() {
        let s = schema();
        let v = s.validate(&json!({"spec": {"n": "one", "s": "no"}}), None);
        assert_eq!(
            fields(&v),
            ["spec.n|FieldValueTypeInvalid", "<nil>|FieldValueInvalid"]
        );
    }

    #[test]
    fn cel_rules_name_their_field_and_transition_rules_need_the_old_object() {
        let s = schema();
        let v = s.validate(&json!({"spec": {"n": 2, "s": "no"}}), None);
        assert_eq!(fields(&v), ["spec.s|FieldValueInvalid"]);
        assert_eq!(v[0].detail, "Invalid value: not no");
        let old = json!({"spec": {"n": 1}});
        let v = s.validate(&json!({"spec": {"n": 2}}), Some(&old));
        assert_eq!(fields(&v), ["spec.n|FieldValueForbidden"]);
        assert_eq!(v[0].detail, "Forbidden: is immutable");
    }

    #[test]
    fn an_update_that_leaves_a_bad_value_alone_passes_ratcheting() {
        let s = schema();
        let old = json!({"metadata": {"labels": {}}, "spec": {"n": 0, "s": "no"}});
        let new = json!({"metadata": {"labels": {"a": "b"}}, "spec": {"n": 0, "s": "no"}});
        assert!(s.validate(&new, Some(&old)).is_empty());
        // A change elsewhere in the node of a cross-field rule re-evaluates it.
        let new = json!({"spec": {"n": 0, "s": "no", "keep": false}});
        assert_eq!(
            fields(&s.validate(&new, Some(&old))),
            ["spec.s|FieldValueInvalid"]
        );
    }

    #[test]
    fn eval_rule_runs_one_rule() {
        let schema = json!({"type": "object", "properties": {"url": {"type": "string"}}});
        let rule = "isURL(self.url) && url(self.url).getScheme() == 'amqp'";
        assert_eq!(
            eval_rule(rule, &schema, &json!({"url": "amqp://h/"})),
            Ok(true)
        );
        assert_eq!(
            eval_rule(rule, &schema, &json!({"url": "http://h/"})),
            Ok(false)
        );
        assert!(eval_rule("self.nope(", &schema, &json!({})).is_err());
    }
}
