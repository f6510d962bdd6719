//! The committed CRD (`crds/dlqreplay.yaml`) is what the types generate, and it carries what
//! `kubectl get` and `kubectl explain` need.
//!
//! `make crd` writes `dlq_replay::api::crd()`: the schema `kube::CustomResourceExt::crd()`
//! derives from `DlqReplay` (with the bounds of its fields: `#[schemars(...)]` in `crates/engine/src/spec/`),
//! plus the CEL rules of `api::rules()` on their nodes (cross-field rules, URLs, and the
//! immutability of every spec field but `suspend`). The drift test compares the committed file
//! to that; a second test checks that `api::crd()` adds nothing but the rules to the derived CRD.

use dlq_replay::api::{self, DlqReplay};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
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
            "crds/dlqreplay.yaml is out of date with the Rust types (crates/engine/src/spec/, crates/api) (first difference at {at}); \
             run `make crd` and commit the result"
        );
    }
}

/// Removes every `x-kubernetes-validations` of the schema; true if there were any.
fn strip_rules(s: &mut JSONSchemaProps) -> bool {
    let mut had = s.x_kubernetes_validations.take().is_some();
    for p in s.properties.iter_mut().flat_map(|p| p.values_mut()) {
        had |= strip_rules(p);
    }
    if let Some(JSONSchemaPropsOrArray::Schema(item)) = &mut s.items {
        had |= strip_rules(item);
    }
    if let Some(JSONSchemaPropsOrBool::Schema(add)) = &mut s.additional_properties {
        had |= strip_rules(add);
    }
    had
}

#[test]
fn generated_crd_is_the_derived_one_plus_the_cel_rules() {
    let derived = DlqReplay::crd();
    let mut without_rules = generated();
    for v in &mut without_rules.spec.versions {
        let root = v
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .expect("openAPIV3Schema");
        assert!(strip_rules(root), "no CEL rules in the CRD");
    }
    let a = serde_yaml::to_value(&without_rules).unwrap();
    let b = serde_yaml::to_value(&derived).unwrap();
    assert!(
        a == b,
        "api::crd() changes more than x-kubernetes-validations (first difference at {})",
        first_difference("", &a, &b).unwrap_or_default()
    );
}

/// The schema node at a rule's `at` (`spec.selector.payload[]`).
fn node<'a>(root: &'a JSONSchemaProps, at: &str) -> &'a JSONSchemaProps {
    at.split('.').fold(root, |n, seg| {
        let (name, each) = match seg.strip_suffix("[]") {
            Some(name) => (name, true),
            None => (seg, false),
        };
        let child = n
            .properties
            .as_ref()
            .and_then(|p| p.get(name))
            .unwrap_or_else(|| panic!("no schema node {at}"));
        match (&child.items, each) {
            (Some(JSONSchemaPropsOrArray::Schema(item)), true) => item,
            (_, true) => panic!("{at}: not a list"),
            (_, false) => child,
        }
    })
}

fn root(crd: &CustomResourceDefinition) -> &JSONSchemaProps {
    crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("openAPIV3Schema")
}

#[test]
fn every_rule_sits_on_its_node() {
    let crd = generated();
    let mut count = 0;
    for r in api::rules() {
        let n = node(root(&crd), r.at);
        let found = n.x_kubernetes_validations.iter().flatten().any(|v| {
            v.rule == r.rule
                && v.field_path == r.field_path
                && v.message.as_deref() == Some(r.message.as_str())
        });
        assert!(found, "rule {:?} is not on {}", r.rule, r.at);
        // kube-apiserver: a message has no line breaks.
        assert!(!r.message.contains('\n'), "{:?}", r.message);
        count += 1;
    }
    let on_nodes = count_rules(root(&crd));
    assert_eq!(
        count, on_nodes,
        "rules in the CRD that api::rules() does not list"
    );
}

fn count_rules(s: &JSONSchemaProps) -> usize {
    let mut n = s.x_kubernetes_validations.as_ref().map_or(0, Vec::len);
    for p in s.properties.iter().flat_map(|p| p.values()) {
        n += count_rules(p);
    }
    if let Some(JSONSchemaPropsOrArray::Schema(item)) = &s.items {
        n += count_rules(item);
    }
    n
}

/// Kubernetes estimates the cost of every rule before it accepts a CRD: a string a rule reads
/// needs a `maxLength`, a list whose items carry rules a `maxItems`, or the estimate assumes the
/// 3 MiB request limit. Ours are bounded.
#[test]
fn what_the_cel_rules_read_is_bounded() {
    let crd = generated();
    for r in api::rules() {
        // The lists on the way to the rule's node.
        let mut path = String::new();
        for seg in r.at.split('.') {
            path = if path.is_empty() {
                seg.to_string()
            } else {
                format!("{path}.{seg}")
            };
            if let Some(list) = path.strip_suffix("[]") {
                let n = node(root(&crd), list);
                assert!(
                    n.max_items.is_some(),
                    "{list} carries rule {:?} but has no maxItems",
                    r.rule
                );
            }
        }
        // The strings the rule reads: `self.a.b` that are strings in the schema.
        let n = node(root(&crd), r.at);
        for (start, _) in r.rule.match_indices("self.") {
            if r.rule[..start].ends_with("has(") {
                continue; // a presence test reads nothing
            }
            let rest = &r.rule[start + "self.".len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '_'))
                .unwrap_or(rest.len());
            let mut target = n;
            for name in rest[..end].split('.') {
                match target.properties.as_ref().and_then(|p| p.get(name)) {
                    Some(child) => target = child,
                    None => break,
                }
            }
            if target.type_.as_deref() == Some("string") {
                assert!(
                    target.max_length.is_some() || target.enum_.is_some(),
                    "rule {:?} reads self.{} (a string without maxLength)",
                    r.rule,
                    &rest[..end]
                );
            }
        }
    }
}

#[test]
fn the_cel_rules_compile() {
    let crd = generated();
    dlq_replay::manifest::structural::CrdSchema::new(&crd, "v1alpha1")
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn immutability_rules_cover_every_spec_field_but_suspend() {
    let crd = generated();
    let spec = spec_schema(&crd);
    let rules = spec.x_kubernetes_validations.as_ref().expect("CEL rules");
    for field in spec.properties.as_ref().expect("spec properties").keys() {
        let rule = rules.iter().find(|r| {
            r.rule.contains("oldSelf") && r.field_path.as_deref() == Some(&format!(".{field}"))
        });
        if field == "suspend" {
            assert!(rule.is_none(), "spec.suspend must stay mutable: {rule:?}");
            continue;
        }
        let rule = rule.unwrap_or_else(|| panic!("spec.{field} is not kept immutable"));
        assert!(
            rule.rule
                .contains(&format!("self.{field} == oldSelf.{field}")),
            "{rule:?}"
        );
        assert_eq!(rule.reason.as_deref(), Some("FieldValueForbidden"));
    }
    assert!(
        rules.iter().all(|r| !r.rule.contains("suspend")),
        "a rule reads spec.suspend"
    );
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
            "Plan",
            "To Replay",
            "Replayed",
            "Duplicates",
            "Quarantined",
            "Failed",
            "Age",
            "Message"
        ]
    );
    for c in cols {
        let expected = if matches!(c.name.as_str(), "Message" | "To Replay") {
            Some(1)
        } else {
            None
        };
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

/// `kubectl explain dlqreplay.spec.rate.burst` says what the engine does: a twentieth of the
/// rate, at least 1 (`engine::limiter`).
#[test]
fn crd_describes_the_default_burst_as_the_engine_uses_it() {
    let crd = generated();
    let burst = node(root(&crd), "spec.rate.burst");
    let description = burst.description.as_deref().unwrap_or("");
    assert!(
        description.contains("twentieth of `messagesPerSecond`")
            && description.contains("at least 1"),
        "{description}"
    );
    assert!(
        !description.contains("Defaults to `messagesPerSecond`"),
        "{description}"
    );
}

/// `kubectl explain dlqreplay.spec.audit.retentionSeconds`: the bounds and the default are the
/// schema's, and the description says them and what expires.
#[test]
fn crd_bounds_and_describes_the_retention() {
    let crd = generated();
    let retention = node(root(&crd), "spec.audit.retentionSeconds");
    assert_eq!(
        (retention.minimum, retention.maximum),
        (Some(3600.0), Some(315_360_000.0))
    );
    assert_eq!(
        retention.default.as_ref().map(|d| d.0.clone()),
        Some(serde_json::json!(2_592_000))
    );
    let description = retention.description.as_deref().unwrap_or("");
    for said in ["3600", "30 days", "audit stream", "replay id"] {
        assert!(description.contains(said), "{said}: {description}");
    }
    // The audit Redis is optional: `audit` may give only the retention.
    let audit = node(root(&crd), "spec.audit");
    assert!(
        audit.required.as_ref().is_none_or(|r| r.is_empty()),
        "{:?}",
        audit.required
    );
}
