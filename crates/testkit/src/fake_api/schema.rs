//! The `DlqReplay`'s CRD (the committed one, or one written to the fake) as the checks of
//! `dlq_replay_validate::structural` see it, and the causes of a refusal.

use super::*;

/// The committed CRD, what a cluster gets from `kubectl apply -f crds/`.
pub(super) const COMMITTED_CRD: &str = include_str!("../../../../crds/dlqreplay.yaml");

/// The committed CRD (`crds/dlqreplay.yaml`).
pub fn committed_crd() -> CustomResourceDefinition {
    serde_yaml::from_str(COMMITTED_CRD).expect("crds/dlqreplay.yaml is a CRD")
}

/// The committed CRD as it was before it carried the bounds of the fields and the rules of
/// `api::rules()`: only the immutability of the spec (its transition rules) is left. A real API
/// server with this CRD admitted `messagesPerSecond: 0` and the like; writing it to the fake
/// (then the committed one again, as an upgrade would) makes such objects.
pub fn crd_before_the_rules() -> CustomResourceDefinition {
    fn strip(schema: &mut Value) {
        let Some(map) = schema.as_object_mut() else {
            return;
        };
        for k in [
            "minimum",
            "maximum",
            "minLength",
            "maxLength",
            "minItems",
            "maxItems",
            "pattern",
        ] {
            map.remove(k);
        }
        if let Some(Value::Array(rules)) = map.get_mut("x-kubernetes-validations") {
            rules.retain(|r| r["rule"].as_str().is_some_and(|r| r.contains("oldSelf")));
        }
        for key in ["properties"] {
            if let Some(Value::Object(props)) = map.get_mut(key) {
                props.values_mut().for_each(strip);
            }
        }
        for key in ["items", "additionalProperties"] {
            if let Some(sub) = map.get_mut(key) {
                strip(sub);
            }
        }
    }
    let mut crd = serde_json::to_value(committed_crd()).expect("CRD as JSON");
    if let Some(versions) = crd["spec"]["versions"].as_array_mut() {
        for v in versions {
            strip(&mut v["schema"]["openAPIV3Schema"]);
        }
    }
    serde_json::from_value(crd).expect("a CRD")
}

pub(super) fn committed_schema() -> Arc<Schemas> {
    static SCHEMA: std::sync::LazyLock<Arc<Schemas>> = std::sync::LazyLock::new(|| {
        Arc::new(
            Schemas::new(&committed_crd(), "v1alpha1").expect("the schema of crds/dlqreplay.yaml"),
        )
    });
    SCHEMA.clone()
}

/// The schema of one version of a CRD, as kube-apiserver checks a custom resource against it:
/// whole (`full`: the OpenAPI schema, then the CEL rules), and without its CEL rules (`shape`;
/// `None` when it has none, as kube-apiserver then has no CEL validator).
pub(super) struct Schemas {
    pub(super) full: CrdSchema,
    pub(super) shape: Option<CrdSchema>,
}

impl Schemas {
    pub(super) fn new(crd: &CustomResourceDefinition, version: &str) -> Result<Schemas, String> {
        fn strip_rules(v: &mut Value) -> bool {
            let mut found = false;
            match v {
                Value::Object(m) => {
                    found = m.remove("x-kubernetes-validations").is_some();
                    for child in m.values_mut() {
                        found |= strip_rules(child);
                    }
                }
                Value::Array(a) => {
                    for child in a {
                        found |= strip_rules(child);
                    }
                }
                _ => {}
            }
            found
        }
        let full = CrdSchema::new(crd, version)?;
        let mut bare = full.schema().clone();
        let shape = if strip_rules(&mut bare) {
            Some(CrdSchema::from_json(bare)?)
        } else {
            None
        };
        Ok(Schemas { full, shape })
    }

    /// kube-apiserver's validation of a pruned and defaulted object (`old`: the stored one of an
    /// update; `status_sub`: a write to `/status`): the schema, then the CEL rules, unless a
    /// blocking schema error (see [`BLOCKING`]) skips them and adds the `<nil>` cause instead.
    pub(super) fn validate(
        &self,
        obj: &Value,
        old: Option<&Value>,
        status_sub: bool,
    ) -> Vec<Cause> {
        let of = |v: &Violation| Cause::of(v, status_sub);
        let all = self.full.validate(obj, old);
        let Some(shape) = &self.shape else {
            // No CEL rules, so no CEL validator and nothing to say was not checked.
            return all
                .iter()
                .filter(|v| !Cause::is_rules_not_checked(v))
                .map(of)
                .collect();
        };
        if !all.iter().any(|v| BLOCKING.contains(&v.reason)) {
            return all.iter().map(of).collect();
        }
        // Which of them are the schema's (a CEL rule may answer `FieldValueRequired` too).
        let mut found: Vec<Cause> = shape
            .validate(obj, old)
            .iter()
            .filter(|v| !Cause::is_rules_not_checked(v))
            .map(of)
            .collect();
        if !found.iter().any(|c| BLOCKING.contains(&c.reason)) {
            return all.iter().map(of).collect();
        }
        found.push(Cause::rules_not_checked());
        found
    }
}

/// One cause of a 422 `Invalid`: the field, the reason and kube-apiserver's text after the field.
pub(super) struct Cause {
    pub(super) field: String,
    pub(super) reason: &'static str,
    pub(super) detail: String,
}

impl Cause {
    /// The cause of a violation as kube-apiserver v1.36 writes it (`structural` writes the
    /// texts as the server does); on the `/status` subresource (`status_sub`), where only
    /// the status is checked against its schema, a schema error's text names the field from the
    /// status down (`counts.scanned in body should ...`).
    pub(super) fn of(v: &Violation, status_sub: bool) -> Cause {
        let mut detail = v.detail.clone();
        if status_sub {
            if let Some(rest) = v.field.strip_prefix("status.") {
                detail = detail.replace(
                    &format!(" {} in body ", v.field),
                    &format!(" {rest} in body "),
                );
            }
        }
        Cause {
            field: v.field.clone(),
            reason: v.reason,
            detail,
        }
    }

    /// What kube-apiserver adds when a blocking schema error kept it from the CEL rules
    /// (`field.Invalid(nil, nil, ...)`: no field, a null value).
    pub(super) fn rules_not_checked() -> Cause {
        Cause {
            field: "<nil>".into(),
            reason: "FieldValueInvalid",
            detail: "Invalid value: null: some validation rules were not checked because the object was invalid; correct the existing errors to complete validation".into(),
        }
    }

    pub(super) fn is_rules_not_checked(v: &Violation) -> bool {
        v.field == "<nil>" && v.detail.contains("some validation rules were not checked")
    }
}
