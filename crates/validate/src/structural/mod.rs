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

mod prune;
mod violations;

use prune::prune_object;
use violations::{ratchet, schema_violation};

use std::collections::HashMap;

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

#[cfg(test)]
mod tests;
