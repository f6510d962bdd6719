//! Unit tests of the structural schema: pruning, defaulting, schema and CEL errors.

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
