//! The committed CRD (`crds/dlqreplay.yaml`) is what the types generate, and it carries what
//! `kubectl get` and `kubectl explain` need.
//!
//! `make crd` writes `dlq_replay::api::crd()`: the schema `kube::CustomResourceExt::crd()`
//! derives from `DlqReplay`, plus a CEL rule on `spec` that keeps the spec immutable except
//! `suspend`. The drift test compares the committed file to that; a second test checks that
//! `api::crd()` adds nothing but the rule to the derived CRD.

use dlq_replay::api::{self, DlqReplay};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
use kube::CustomResourceExt;
use serde_yaml::Value;

const COMMITTED: &str = include_str!("../crds/dlqreplay.yaml");

/// What `make crd` writes.
fn generated() -> CustomResourceDefinition {
    api::crd()
}

/// The `spec` property of the only version's schema.
fn spec_schema(crd: &CustomResourceDefinition) -> &JSONSchemaProps {
    crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| s.properties.as_ref())
        .and_then(|p| p.get("spec"))
        .expect("openAPIV3Schema.properties.spec")
}

/// The first place where `a` and `b` differ, as a path like `spec.versions[0].name`.
fn first_difference(path: &str, a: &Value, b: &Value) -> Option<String> {
    match (a, b) {
        (Value::Mapping(ma), Value::Mapping(mb)) => {
            for (k, va) in ma {
                let key = k
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("{k:?}"));
                let p = if path.is_empty() {
                    key
                } else {
                    format!("{path}.{key}")
                };
                match mb.get(k) {
                    Some(vb) => {
                        if let Some(d) = first_difference(&p, va, vb) {
                            return Some(d);
                        }
                    }
                    None => return Some(format!("{p} (only in the generated CRD)")),
                }
            }
            mb.keys().find(|k| !ma.contains_key(*k)).map(|k| {
                let key = k
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("{k:?}"));
                format!("{path}.{key} (only in crds/dlqreplay.yaml)")
            })
        }
        (Value::Sequence(sa), Value::Sequence(sb)) => {
            for (i, (va, vb)) in sa.iter().zip(sb).enumerate() {
                if let Some(d) = first_difference(&format!("{path}[{i}]"), va, vb) {
                    return Some(d);
                }
            }
            (sa.len() != sb.len()).then(|| {
                format!(
                    "{path} ({} items generated, {} committed)",
                    sa.len(),
                    sb.len()
                )
            })
        }
        _ => (a != b).then(|| format!("{path}: generated {a:?}, committed {b:?}")),
    }
}

#[test]
fn committed_crd_matches_the_types() {
    let text = serde_yaml::to_string(&generated()).expect("serialize the CRD");
    let generated: Value = serde_yaml::from_str(&text).expect("reparse the generated CRD");
    let committed: Value = serde_yaml::from_str(COMMITTED).expect("crds/dlqreplay.yaml is YAML");
    if generated != committed {
        let at = first_difference("", &generated, &committed).unwrap_or_default();
        panic!(
            "crds/dlqreplay.yaml is out of date with src/api.rs (first difference at {at}); \
             run `make crd` and commit the result"
        );
    }
}

#[test]
fn generated_crd_is_the_derived_one_plus_the_immutability_rule() {
    let derived = DlqReplay::crd();
    let mut with_rule = generated();
    for v in &mut with_rule.spec.versions {
        let spec = v
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .and_then(|s| s.properties.as_mut())
            .and_then(|p| p.get_mut("spec"))
            .expect("openAPIV3Schema.properties.spec");
        assert!(
            spec.x_kubernetes_validations.take().is_some(),
            "no CEL rule on spec"
        );
    }
    let a = serde_yaml::to_value(&with_rule).unwrap();
    let b = serde_yaml::to_value(&derived).unwrap();
    assert!(
        a == b,
        "api::crd() changes more than spec's x-kubernetes-validations (first difference at {})",
        first_difference("", &a, &b).unwrap_or_default()
    );
}

#[test]
fn immutability_rule_covers_every_spec_field_but_suspend() {
    let crd = generated();
    let spec = spec_schema(&crd);
    let rules = spec.x_kubernetes_validations.as_ref().expect("CEL rules");
    assert_eq!(rules.len(), 1);
    let rule = &rules[0].rule;
    for field in spec.properties.as_ref().expect("spec properties").keys() {
        let mentioned = rule.contains(&format!("self.{field} == oldSelf.{field}"));
        if field == "suspend" {
            assert!(!mentioned, "spec.suspend must stay mutable: {rule}");
        } else {
            assert!(mentioned, "spec.{field} is not kept immutable: {rule}");
        }
    }
}

#[test]
fn crd_names_scope_and_version() {
    let crd = generated();
    let spec = &crd.spec;
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("dlqreplays.replay.dlq.dev")
    );
    assert_eq!(spec.group, "replay.dlq.dev");
    assert_eq!(spec.names.kind, "DlqReplay");
    assert_eq!(spec.names.plural, "dlqreplays");
    assert_eq!(
        spec.names.short_names.as_deref(),
        Some(&["dlqr".to_string()][..])
    );
    assert_eq!(spec.scope, "Namespaced");
    assert_eq!(spec.versions.len(), 1);
    let v = &spec.versions[0];
    assert_eq!(v.name, "v1alpha1");
    assert!(v.served && v.storage);
    let sub = v.subresources.as_ref().expect("subresources");
    assert!(sub.status.is_some(), "no status subresource");
}

#[test]
fn crd_printer_columns() {
    let crd = generated();
    let cols = crd.spec.versions[0]
        .additional_printer_columns
        .as_ref()
        .expect("additionalPrinterColumns");
    let names: Vec<&str> = cols.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "Phase",
            "Replayed",
            "Duplicates",
            "Quarantined",
            "Failed",
            "Age",
            "Message"
        ]
    );
    for c in cols {
        let expected = if c.name == "Message" { Some(1) } else { None };
        assert_eq!(c.priority, expected, "priority of column {}", c.name);
    }
    let age = cols.iter().find(|c| c.name == "Age").unwrap();
    assert_eq!(
        (age.type_.as_str(), age.json_path.as_str()),
        ("date", ".metadata.creationTimestamp")
    );
}

#[test]
fn crd_describes_the_canary_for_kubectl_explain() {
    let crd = generated();
    let canary = spec_schema(&crd)
        .properties
        .as_ref()
        .and_then(|p| p.get("canary"))
        .expect("spec.properties.canary");
    let description = canary.description.as_deref().unwrap_or("");
    assert!(
        !description.trim().is_empty(),
        "spec.canary has no description; `kubectl explain dlqreplay.spec.canary` would print none"
    );
}
