//! An in-process fake Kubernetes API server for controller tests.
//!
//! There is no API server on the test machines, so controller tests talk to this one instead: a
//! plain-HTTP server on `127.0.0.1:0` that keeps objects in memory and answers the subset of the
//! Kubernetes REST API that `kube::Api`, `kube::runtime::watcher`, the finalizer helper and the
//! event recorder use. `tests/fake_api.rs` checks it against the behaviour of a real cluster.
//!
//! What it models: a global resourceVersion, uid/creationTimestamp/generation, the `/status`
//! subresource, GET/LIST/CREATE/PUT/PATCH (merge, JSON, strategic-as-merge, apply-as-merge)/DELETE
//! (with finalizers and deletionTimestamp), streaming watches replayed from any resourceVersion,
//! and `410 Gone` after [`FakeApi::expire_watches`].
//!
//! `DlqReplay` objects are checked as kube-apiserver v1.36 checks a custom resource against its
//! CRD (the committed `crds/dlqreplay.yaml`, or a `CustomResourceDefinition` written to the fake,
//! as by `kubectl apply -f crds/`), on every create, update and patch of the object and of its
//! `/status`: unknown fields pruned (a `Warning` header; `fieldValidation=Strict` refuses them:
//! a create or replace with 400 `BadRequest`, a merge or JSON patch with 422 `Invalid` and one
//! cause, field `patch`; a server-side apply that sets one fails with 500, "field not declared in
//! schema"), schema defaults applied, then the OpenAPI schema and the CEL rules (transition rules
//! against the stored object) validated, with ratcheting: what an update leaves unchanged is not
//! refused. A refusal is a 422 `Invalid` `Status` whose `details.causes` name each field. As in
//! kube-apiserver, a schema error of the kinds that block the CEL rules (a wrong type, a missing
//! required field, a value outside the enum, too long, too many) skips them and adds a cause with
//! field `<nil>` ("some validation rules were not checked because the object was invalid"). The
//! checking itself is `dlq_replay_validate::structural` (jsonschema and kube-cel).
//!
//! What it does not model: authentication, admission webhooks, validation of built-in kinds,
//! garbage collection of owned objects, namespace lifecycle, managedFields and real
//! server-side-apply field ownership.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use dlq_replay_validate::structural::{CrdSchema, Violation, BLOCKING};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// A resource type the fake serves.
#[derive(Debug, Clone, Copy)]
struct Kind {
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    /// Has a `/status` subresource: the main resource cannot write `.status` and vice versa.
    status: bool,
}

impl Kind {
    const fn new(
        group: &'static str,
        version: &'static str,
        plural: &'static str,
        kind: &'static str,
        namespaced: bool,
        status: bool,
    ) -> Self {
        Self {
            group,
            version,
            plural,
            kind,
            namespaced,
            status,
        }
    }

    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `dlqreplays.replay.dlq.dev` or `secrets`, as real error messages name a resource.
    fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    fn is_event(&self) -> bool {
        self.plural == "events"
    }

    /// A custom resource (served through a CRD) rather than a built-in one.
    fn is_custom(&self) -> bool {
        !(self.group.is_empty() || self.group.ends_with(".k8s.io") || !self.group.contains('.'))
    }

    /// Checked against its CRD's structural schema: the `DlqReplay`.
    fn has_schema(&self) -> bool {
        self.group == dlq_replay_api::GROUP && self.plural == "dlqreplays"
    }

    /// The name of the CRD that serves this kind, `dlqreplays.replay.dlq.dev`.
    fn crd_name(&self) -> String {
        format!("{}.{}", self.plural, self.group)
    }
}

/// The committed CRD, what a cluster gets from `kubectl apply -f crds/`.
const COMMITTED_CRD: &str = include_str!("../../../crds/dlqreplay.yaml");

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

fn committed_schema() -> Arc<Schemas> {
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
struct Schemas {
    full: CrdSchema,
    shape: Option<CrdSchema>,
}

/// One cause of a 422 `Invalid`: the field, the reason and kube-apiserver's text after the field.
struct Cause {
    field: String,
    reason: &'static str,
    detail: String,
}

impl Cause {
    /// The cause of a violation as kube-apiserver v1.36 writes it (`structural` writes the
    /// texts as the server does); on the `/status` subresource (`status_sub`), where only
    /// the status is checked against its schema, a schema error's text names the field from the
    /// status down (`counts.scanned in body should ...`).
    fn of(v: &Violation, status_sub: bool) -> Cause {
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
    fn rules_not_checked() -> Cause {
        Cause {
            field: "<nil>".into(),
            reason: "FieldValueInvalid",
            detail: "Invalid value: null: some validation rules were not checked because the object was invalid; correct the existing errors to complete validation".into(),
        }
    }

    fn is_rules_not_checked(v: &Violation) -> bool {
        v.field == "<nil>" && v.detail.contains("some validation rules were not checked")
    }
}

impl Schemas {
    fn new(crd: &CustomResourceDefinition, version: &str) -> Result<Schemas, String> {
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
    fn validate(&self, obj: &Value, old: Option<&Value>, status_sub: bool) -> Vec<Cause> {
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

const KINDS: &[Kind] = &[
    Kind::new(
        "replay.dlq.dev",
        "v1alpha1",
        "dlqreplays",
        "DlqReplay",
        true,
        true,
    ),
    Kind::new("", "v1", "secrets", "Secret", true, false),
    Kind::new("", "v1", "configmaps", "ConfigMap", true, false),
    Kind::new("", "v1", "events", "Event", true, false),
    Kind::new("events.k8s.io", "v1", "events", "Event", true, false),
    Kind::new("coordination.k8s.io", "v1", "leases", "Lease", true, false),
    Kind::new("", "v1", "pods", "Pod", true, true),
    Kind::new("", "v1", "services", "Service", true, true),
    Kind::new("", "v1", "serviceaccounts", "ServiceAccount", true, false),
    Kind::new("", "v1", "namespaces", "Namespace", false, true),
    Kind::new("batch", "v1", "jobs", "Job", true, true),
    Kind::new("apps", "v1", "deployments", "Deployment", true, true),
    Kind::new(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        false,
        true,
    ),
];

fn kind_index(group: &str, version: &str, plural: &str) -> Option<usize> {
    KINDS
        .iter()
        .position(|k| k.group == group && k.version == version && k.plural == plural)
}

/// (kind index, namespace or "" for cluster-scoped, name)
type Key = (usize, String, String);

/// A label or field requirement of a selector.
#[derive(Debug, Clone)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

impl Req {
    fn matches(&self, get: &dyn Fn(&str) -> Option<String>) -> bool {
        match self {
            Req::Eq(k, v) => get(k).as_deref() == Some(v.as_str()),
            Req::Ne(k, v) => get(k).as_deref() != Some(v.as_str()),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Req::NotIn(k, vs) => !get(k).is_some_and(|x| vs.contains(&x)),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
        }
    }
}

/// Splits `a=b,c in (x,y),!d` at the commas outside parentheses.
fn split_selector(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn parse_selector(s: &str) -> Vec<Req> {
    let set = |v: &str| -> Vec<String> {
        v.trim()
            .trim_start_matches('(')
            .trim_end_matches(')')
            .split(',')
            .map(|x| x.trim().to_string())
            .collect()
    };
    split_selector(s)
        .into_iter()
        .filter_map(|term| {
            if let Some((k, v)) = term.split_once("!=") {
                Some(Req::Ne(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = term.split_once("==") {
                Some(Req::Eq(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = term.split_once('=') {
                Some(Req::Eq(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = term.split_once(" notin ") {
                Some(Req::NotIn(k.trim().into(), set(v)))
            } else if let Some((k, v)) = term.split_once(" in ") {
                Some(Req::In(k.trim().into(), set(v)))
            } else if let Some(k) = term.strip_prefix('!') {
                Some(Req::NotExists(k.trim().into()))
            } else if term.contains(char::is_whitespace) {
                None
            } else {
                Some(Req::Exists(term))
            }
        })
        .collect()
}

/// Which objects a list or watch sees.
#[derive(Debug, Clone, Default)]
struct Filter {
    namespace: Option<String>,
    labels: Vec<Req>,
    /// Only `metadata.name` and `metadata.namespace` are understood; other fields are ignored.
    fields: Vec<Req>,
}

impl Filter {
    fn from_query(namespace: Option<String>, q: &HashMap<String, String>) -> Self {
        let fields = q
            .get("fieldSelector")
            .map(|s| parse_selector(s))
            .unwrap_or_default()
            .into_iter()
            .filter(|r| {
                let k = match r {
                    Req::Eq(k, _) | Req::Ne(k, _) | Req::In(k, _) | Req::NotIn(k, _) => k,
                    Req::Exists(k) | Req::NotExists(k) => k,
                };
                k == "metadata.name" || k == "metadata.namespace"
            })
            .collect();
        Self {
            namespace,
            labels: q
                .get("labelSelector")
                .map(|s| parse_selector(s))
                .unwrap_or_default(),
            fields,
        }
    }

    fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        if let Some(ns) = &self.namespace {
            if meta["namespace"].as_str().unwrap_or("") != ns {
                return false;
            }
        }
        let label = |k: &str| meta["labels"][k].as_str().map(str::to_string);
        let field = |k: &str| match k {
            "metadata.name" => meta["name"].as_str().map(str::to_string),
            "metadata.namespace" => meta["namespace"].as_str().map(str::to_string),
            _ => None,
        };
        self.labels.iter().all(|r| r.matches(&label))
            && self.fields.iter().all(|r| r.matches(&field))
    }
}

struct Watcher {
    kind: usize,
    filter: Filter,
    tx: mpsc::UnboundedSender<Value>,
}

struct HistoryEntry {
    kind: usize,
    rv: u64,
    event: Value,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// Watches from a resourceVersion below this answer 410 Gone.
    compacted: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<HistoryEntry>,
    watchers: Vec<Watcher>,
    /// Events in creation order, with their latest stored form.
    event_keys: Vec<Key>,
    event_last: HashMap<Key, Value>,
    status_writes: HashMap<(String, String), usize>,
    /// Which field manager last set each field (JSON pointer) of each object, for the
    /// conflicts of server-side apply.
    owners: HashMap<Key, BTreeMap<String, String>>,
    /// The schema of a `CustomResourceDefinition` written to the fake, by its resourceVersion.
    crd_schema: Option<(String, Arc<Schemas>)>,
    /// The `Warning` headers of the request being answered.
    warnings: Vec<String>,
}

/// What a write request says besides its body.
#[derive(Debug, Clone, Default)]
struct Ctx {
    /// `dryRun`: answer as if written, store nothing.
    dry_run: bool,
    /// `force=true`: a server-side apply takes over fields other managers own.
    force: bool,
    /// `fieldManager`, else the User-Agent's product, else `unknown`.
    manager: String,
    /// `fieldValidation`: `Strict` refuses unknown fields, `Ignore` drops them silently, and
    /// `Warn` (the default) drops them with a `Warning` header.
    field_validation: Option<String>,
}

/// An error answer: HTTP code, reason and message of a `Status`.
struct ApiError {
    code: u16,
    reason: &'static str,
    message: String,
    details: Option<Value>,
}

type ApiResult<T> = Result<T, ApiError>;

fn err(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        code,
        reason,
        message: message.into(),
        details: None,
    }
}

fn obj_err(code: u16, reason: &'static str, kind: &Kind, name: &str, what: &str) -> ApiError {
    ApiError {
        code,
        reason,
        message: match reason {
            "Conflict" => format!(
                "Operation cannot be fulfilled on {} \"{name}\": {what}",
                kind.qualified()
            ),
            _ => format!("{} \"{name}\" {what}", kind.qualified()),
        },
        details: Some(json!({"name": name, "group": kind.group, "kind": kind.plural})),
    }
}

fn not_found(kind: &Kind, name: &str) -> ApiError {
    obj_err(404, "NotFound", kind, name, "not found")
}

/// kube-apiserver's answer to an object its schema or CEL rules refuse: 422 `Invalid`, one
/// cause per field.
fn invalid(kind: &Kind, name: &str, violations: &[Cause]) -> ApiError {
    let each: Vec<String> = violations
        .iter()
        .map(|c| format!("{}: {}", c.field, c.detail))
        .collect();
    let summary = match each.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    };
    let causes: Vec<Value> = violations
        .iter()
        .map(|c| json!({"reason": c.reason, "message": c.detail, "field": c.field}))
        .collect();
    ApiError {
        code: 422,
        reason: "Invalid",
        message: format!(
            "{}.{} \"{name}\" is invalid: {summary}",
            kind.kind, kind.group
        ),
        details: Some(json!({
            "name": name,
            "group": kind.group,
            "kind": kind.kind,
            "causes": causes,
        })),
    }
}

fn status_body(e: &ApiError) -> Value {
    let mut v = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": e.message,
        "reason": e.reason,
        "code": e.code,
    });
    if e.reason.is_empty() {
        // As kube-apiserver's answer to an error it has no reason for (a 500).
        if let Some(m) = v.as_object_mut() {
            m.remove("reason");
        }
    }
    if let Some(d) = &e.details {
        v["details"] = d.clone();
    }
    v
}

fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// The object minus what does not count as a spec change.
fn spec_part(obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Some(m) = v.as_object_mut() {
        for k in ["metadata", "status", "apiVersion", "kind"] {
            m.remove(k);
        }
    }
    v
}

fn finalizers(obj: &Value) -> usize {
    obj["metadata"]["finalizers"]
        .as_array()
        .map(Vec::len)
        .unwrap_or(0)
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj["metadata"].is_object() {
        obj["metadata"] = json!({});
    }
    obj["metadata"]
        .as_object_mut()
        .expect("metadata is an object")
}

/// What the real API server does to every stored object: empty metadata collections are
/// omitted, a Secret's `stringData` is folded into `data`.
fn normalize(kind: &Kind, obj: &mut Value) {
    let meta = meta_mut(obj);
    for k in ["finalizers", "labels", "annotations", "ownerReferences"] {
        let empty = match meta.get(k) {
            Some(Value::Array(a)) => a.is_empty(),
            Some(Value::Object(o)) => o.is_empty(),
            Some(Value::Null) => true,
            _ => false,
        };
        if empty {
            meta.remove(k);
        }
    }
    if kind.plural == "secrets" {
        if let Some(Value::Object(sd)) = obj.as_object_mut().and_then(|o| o.remove("stringData")) {
            if !obj["data"].is_object() {
                obj["data"] = json!({});
            }
            for (k, v) in sd {
                let text = v.as_str().unwrap_or_default().to_string();
                obj["data"][k] = json!(base64::engine::general_purpose::STANDARD.encode(text));
            }
        }
    }
}

fn set_status(target: &mut Value, from: &Value) {
    if let Some(m) = target.as_object_mut() {
        match from.get("status") {
            Some(s) if !s.is_null() => {
                m.insert("status".into(), s.clone());
            }
            _ => {
                m.remove("status");
            }
        }
    }
}

impl State {
    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// The schema `kind`'s objects are checked against: that of its CRD when one was written to
    /// the fake (as after `kubectl apply -f` of another version of the CRD), else the committed
    /// one.
    fn schema_of(&mut self, kind: &Kind) -> Arc<Schemas> {
        let Some(crds) = KINDS
            .iter()
            .position(|k| k.plural == "customresourcedefinitions")
        else {
            return committed_schema();
        };
        let Some(stored) = self
            .objects
            .get(&(crds, String::new(), kind.crd_name()))
            .cloned()
        else {
            return committed_schema();
        };
        let rv = stored["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if let Some((cached_rv, schema)) = &self.crd_schema {
            if *cached_rv == rv {
                return schema.clone();
            }
        }
        let schema = serde_json::from_value::<CustomResourceDefinition>(stored)
            .map_err(|e| e.to_string())
            .and_then(|crd| Schemas::new(&crd, kind.version));
        match schema {
            Ok(schema) => {
                let schema = Arc::new(schema);
                self.crd_schema = Some((rv, schema.clone()));
                schema
            }
            Err(e) => panic!(
                "the CustomResourceDefinition {} written to the fake: {e}",
                kind.crd_name()
            ),
        }
    }

    /// What kube-apiserver does to a custom resource before it stores it: prunes unknown fields
    /// (a warning, or with `fieldValidation=Strict` a 400: a patch is checked before, by
    /// [`State::strict_patch`]), applies the schema's defaults, and
    /// validates the schema and the CEL rules (`old`: the stored object of an update, for
    /// transition rules and ratcheting), refusing with 422.
    fn admit(
        &mut self,
        k: usize,
        name: &str,
        obj: &mut Value,
        old: Option<&Value>,
        status_sub: bool,
        ctx: &Ctx,
    ) -> ApiResult<()> {
        let kind = KINDS[k];
        if !kind.has_schema() {
            return Ok(());
        }
        let schema = self.schema_of(&kind);
        let unknown = schema.full.prune(obj);
        if !unknown.is_empty() {
            let each: Vec<String> = unknown
                .iter()
                .map(|f| format!("unknown field \"{f}\""))
                .collect();
            match ctx.field_validation.as_deref() {
                Some("Strict") => {
                    return Err(err(
                        400,
                        "BadRequest",
                        format!(
                        "{} in version \"{}\" cannot be handled as a {}: strict decoding error: {}",
                        kind.kind,
                        kind.version,
                        kind.kind,
                        each.join(", ")
                    ),
                    ))
                }
                Some("Ignore") => {}
                _ => self.warnings.extend(each),
            }
        }
        schema.full.default(obj);
        let violations = schema.validate(obj, old, status_sub);
        if violations.is_empty() {
            Ok(())
        } else {
            Err(invalid(&kind, name, &violations))
        }
    }

    /// A server-side apply may not set a field the schema does not declare: kube-apiserver
    /// v1.36 fails it with a 500 (structured-merge-diff cannot type the patch).
    fn check_apply_fields(&mut self, key: &Key, patch: &Value) -> ApiResult<()> {
        let kind = KINDS[key.0];
        if !kind.has_schema() {
            return Ok(());
        }
        let mut probe = patch.clone();
        let unknown = self.schema_of(&kind).full.prune(&mut probe);
        match unknown.first() {
            None => Ok(()),
            Some(field) => Err(err(
                500,
                "",
                format!(
                    "failed to create typed patch object ({}/{}; {}, Kind={}): .{field}: field not declared in schema",
                    key.1,
                    key.2,
                    kind.api_version(),
                    kind.kind
                ),
            )),
        }
    }

    /// `fieldValidation=Strict` on a merge or JSON patch: kube-apiserver decodes the patched
    /// object strictly and refuses an unknown field anywhere in it (also outside the part the
    /// subresource writes) with 422 `Invalid`, no kind or name, and one cause, field `patch`,
    /// whose value is the patched object.
    fn strict_patch(&mut self, key: &Key, patched: &Value, ctx: &Ctx) -> ApiResult<()> {
        let kind = KINDS[key.0];
        if ctx.field_validation.as_deref() != Some("Strict") || !kind.has_schema() {
            return Ok(());
        }
        let mut probe = patched.clone();
        let unknown = self.schema_of(&kind).full.prune(&mut probe);
        if unknown.is_empty() {
            return Ok(());
        }
        let each: Vec<String> = unknown
            .iter()
            .map(|f| format!("unknown field \"{f}\""))
            .collect();
        let value = Value::String(patched.to_string()).to_string();
        let detail = format!(
            "Invalid value: {value}: strict decoding error: {}",
            each.join(", ")
        );
        Err(ApiError {
            code: 422,
            reason: "Invalid",
            message: format!(" \"\" is invalid: patch: {detail}"),
            details: Some(json!({
                "causes": [{"reason": "FieldValueInvalid", "message": detail, "field": "patch"}],
            })),
        })
    }

    /// Records a change for watches and the history.
    fn emit(&mut self, kind: usize, etype: &str, obj: &Value) {
        let event = json!({"type": etype, "object": obj});
        self.history.push(HistoryEntry {
            kind,
            rv: self.rv,
            event: event.clone(),
        });
        self.watchers.retain(|w| {
            if w.kind != kind || !w.filter.matches(obj) {
                return !w.tx.is_closed();
            }
            w.tx.send(event.clone()).is_ok()
        });
        if KINDS[kind].is_event() {
            let key = (
                kind,
                obj["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                obj["metadata"]["name"].as_str().unwrap_or("").to_string(),
            );
            if etype == "ADDED" {
                self.event_keys.push(key.clone());
            }
            self.event_last.insert(key, obj.clone());
        }
    }

    fn create(&mut self, k: usize, ns: &str, mut body: Value, ctx: &Ctx) -> ApiResult<Value> {
        let kind = KINDS[k];
        if !body.is_object() {
            return Err(err(400, "BadRequest", "the body must be a JSON object"));
        }
        body["apiVersion"] = json!(kind.api_version());
        body["kind"] = json!(kind.kind);
        let meta = meta_mut(&mut body);
        let mut name = meta
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if name.is_empty() {
            if let Some(prefix) = meta.get("generateName").and_then(Value::as_str) {
                name = format!(
                    "{prefix}{}",
                    &uuid::Uuid::new_v4().simple().to_string()[..5]
                );
            }
        }
        if name.is_empty() {
            return Err(err(
                422,
                "Invalid",
                format!(
                    "{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                    kind.kind
                ),
            ));
        }
        if kind.namespaced {
            match meta.get("namespace").and_then(Value::as_str) {
                Some(other) if !other.is_empty() && other != ns => {
                    return Err(err(
                        400,
                        "BadRequest",
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ))
                }
                _ => {}
            }
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
        let key: Key = (
            k,
            if kind.namespaced {
                ns.into()
            } else {
                String::new()
            },
            name.clone(),
        );
        if self.objects.contains_key(&key) {
            return Err(obj_err(
                409,
                "AlreadyExists",
                &kind,
                &name,
                "already exists",
            ));
        }
        meta.insert("name".into(), json!(name));
        meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        meta.insert("generation".into(), json!(1));
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        meta.remove("resourceVersion");
        meta.remove("managedFields");
        if kind.status {
            if let Some(m) = body.as_object_mut() {
                m.remove("status");
            }
        }
        normalize(&kind, &mut body);
        self.admit(k, &name, &mut body, None, false, ctx)?;
        if ctx.dry_run {
            return Ok(body);
        }
        let rv = self.bump();
        body["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.record_owners(&key, None, &body, &ctx.manager, None);
        self.objects.insert(key, body.clone());
        self.emit(k, "ADDED", &body);
        Ok(body)
    }

    /// Stores `new` in place of `old` (which is stored under `key`), as the real server would:
    /// immutable metadata kept, `.status` only through the subresource, generation bumped on spec
    /// changes, no-op writes not bumping the resourceVersion, and an object being deleted removed
    /// once its last finalizer is gone.
    fn commit_update(
        &mut self,
        key: &Key,
        old: &Value,
        mut new: Value,
        status_sub: bool,
        ctx: &Ctx,
        applied: Option<&Value>,
    ) -> ApiResult<Value> {
        let kind = KINDS[key.0];
        if !new.is_object() {
            return Err(err(400, "BadRequest", "the body must be a JSON object"));
        }
        if status_sub {
            // Only `.status` changes through /status.
            let mut merged = old.clone();
            set_status(&mut merged, &new);
            new = merged;
        } else {
            if let Some(uid) = new["metadata"]["uid"].as_str() {
                if !uid.is_empty() && Some(uid) != old["metadata"]["uid"].as_str() {
                    return Err(obj_err(
                        409,
                        "Conflict",
                        &kind,
                        &key.2,
                        "Precondition failed: UID in precondition does not match the UID in record",
                    ));
                }
            }
            new["apiVersion"] = json!(kind.api_version());
            new["kind"] = json!(kind.kind);
            let old_meta = old["metadata"].clone();
            let meta = meta_mut(&mut new);
            for k in [
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
            ] {
                match old_meta.get(k) {
                    Some(v) => {
                        meta.insert(k.into(), v.clone());
                    }
                    None => {
                        meta.remove(k);
                    }
                }
            }
            meta.remove("managedFields");
            if kind.status {
                set_status(&mut new, old);
            }
        }
        normalize(&kind, &mut new);
        self.admit(key.0, &key.2, &mut new, Some(old), status_sub, ctx)?;
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if spec_part(&new) != spec_part(old) {
            let generation = old["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
            new["metadata"]["generation"] = json!(generation);
        }
        let deleting = !new["metadata"]["deletionTimestamp"].is_null();
        if new == *old && !(deleting && finalizers(&new) == 0) {
            // A no-op write: nothing stored, no event, same resourceVersion.
            return Ok(new);
        }
        if ctx.dry_run {
            return Ok(new);
        }
        let rv = self.bump();
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        if deleting && finalizers(&new) == 0 {
            self.objects.remove(key);
            self.owners.remove(key);
            self.emit(key.0, "DELETED", &new);
        } else {
            self.record_owners(key, Some(old), &new, &ctx.manager, applied);
            self.objects.insert(key.clone(), new.clone());
            self.emit(key.0, "MODIFIED", &new);
        }
        Ok(new)
    }

    /// Server-side apply without `force`: a field the patch sets to a new value while another
    /// manager owns it is a conflict (409), as on the real server. Field ownership is tracked per
    /// leaf (JSON pointer), without the real server's list-merge keys.
    fn apply_conflicts(
        &self,
        key: &Key,
        old: &Value,
        patch: &Value,
        status_sub: bool,
        manager: &str,
    ) -> ApiResult<()> {
        let Some(owners) = self.owners.get(key) else {
            return Ok(());
        };
        let has_status = KINDS[key.0].status;
        let mut conflicts = Vec::new();
        for (path, value) in leaves(patch) {
            let in_status = path == "/status" || path.starts_with("/status/");
            if value.is_null() || (has_status && in_status != status_sub) {
                continue;
            }
            let Some(current) = old.pointer(&path) else {
                continue;
            };
            if *current == value {
                continue;
            }
            if let Some(owner) = owners.get(&path).filter(|o| o.as_str() != manager) {
                conflicts.push((
                    format!("conflict with \"{owner}\""),
                    format!(".{}", path.trim_start_matches('/').replace('/', ".")),
                ));
            }
        }
        if conflicts.is_empty() {
            return Ok(());
        }
        // As kube-apiserver: no name, group or kind, one `FieldManagerConflict` cause per field.
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|(m, f)| json!({"reason": "FieldManagerConflict", "message": m, "field": f}))
            .collect();
        let each: Vec<String> = conflicts.iter().map(|(m, f)| format!("{m}: {f}")).collect();
        Err(ApiError {
            code: 409,
            reason: "Conflict",
            message: format!(
                "Apply failed with {} conflict{}: {}",
                conflicts.len(),
                if conflicts.len() == 1 { "" } else { "s" },
                each.join(", ")
            ),
            details: Some(json!({ "causes": causes })),
        })
    }

    /// Records `manager` as the owner of every field it changed (and, for an apply, of every
    /// field it applied).
    fn record_owners(
        &mut self,
        key: &Key,
        old: Option<&Value>,
        new: &Value,
        manager: &str,
        applied: Option<&Value>,
    ) {
        let before = old.map(leaves).unwrap_or_default();
        let after = leaves(new);
        let owners = self.owners.entry(key.clone()).or_default();
        owners.retain(|p, _| after.contains_key(p));
        for (p, v) in &after {
            if before.get(p) != Some(v) {
                owners.insert(p.clone(), manager.to_string());
            }
        }
        if let Some(a) = applied {
            for (p, v) in leaves(a) {
                if !v.is_null() && after.contains_key(&p) {
                    owners.insert(p, manager.to_string());
                }
            }
        }
    }

    fn get(&self, key: &Key) -> ApiResult<Value> {
        self.objects
            .get(key)
            .cloned()
            .ok_or_else(|| not_found(&KINDS[key.0], &key.2))
    }

    fn update(&mut self, key: &Key, body: Value, status_sub: bool, ctx: &Ctx) -> ApiResult<Value> {
        let kind = KINDS[key.0];
        let old = self.get(key)?;
        if let Some(name) = body["metadata"]["name"].as_str() {
            if name != key.2 {
                return Err(err(
                    400,
                    "BadRequest",
                    "the name of the object does not match the name on the URL",
                ));
            }
        }
        if let Some(rv) = body["metadata"]["resourceVersion"].as_str() {
            if !rv.is_empty() && Some(rv) != old["metadata"]["resourceVersion"].as_str() {
                return Err(obj_err(
                    409,
                    "Conflict",
                    &kind,
                    &key.2,
                    "the object has been modified; please apply your changes to the latest version and try again",
                ));
            }
        }
        self.commit_update(key, &old, body, status_sub, ctx, None)
    }

    fn patch(
        &mut self,
        key: &Key,
        content_type: &str,
        body: &[u8],
        status_sub: bool,
        ctx: &Ctx,
    ) -> ApiResult<(StatusCode, Value)> {
        let kind = KINDS[key.0];
        let bad = |e: String| err(400, "BadRequest", format!("cannot decode the patch: {e}"));
        if content_type == "application/apply-patch+yaml" {
            let applied = parse_json_or_yaml(body).map_err(bad)?;
            self.check_apply_fields(key, &applied)?;
        }
        let old = match self.objects.get(key) {
            Some(o) => o.clone(),
            None if content_type == "application/apply-patch+yaml" && !status_sub => {
                let mut obj = parse_json_or_yaml(body).map_err(bad)?;
                if obj.is_object() && obj["metadata"]["name"].is_null() {
                    meta_mut(&mut obj).insert("name".into(), json!(key.2));
                }
                return self
                    .create(key.0, &key.1, obj, ctx)
                    .map(|o| (StatusCode::CREATED, o));
            }
            None => return Err(not_found(&kind, &key.2)),
        };
        if content_type == "application/strategic-merge-patch+json" && kind.is_custom() {
            // As the real server: custom resources have no strategic merge schema.
            return Err(err(
                415,
                "UnsupportedMediaType",
                "strategic merge patch is not supported for custom resources",
            ));
        }
        let mut doc = old.clone();
        let mut applied = None;
        match content_type {
            "application/json-patch+json" => {
                let patch: json_patch::Patch =
                    serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
                for op in patch.0.iter() {
                    if let json_patch::PatchOperation::Test(t) = op {
                        // As the real server (evanphx/json-patch): testing a missing path for null
                        // succeeds; kube's finalizer helper relies on it.
                        if t.value.is_null() && doc.pointer(t.path.as_str()).is_none() {
                            continue;
                        }
                    }
                    // As kube-apiserver: a failed test or a missing path says no more than this.
                    json_patch::patch(&mut doc, std::slice::from_ref(op)).map_err(|_| {
                        ApiError {
                            code: 422,
                            reason: "Invalid",
                            message:
                                "the server rejected our request due to an error in our request"
                                    .into(),
                            details: Some(json!({})),
                        }
                    })?;
                }
            }
            "application/merge-patch+json"
            | "application/strategic-merge-patch+json"
            | "application/apply-patch+yaml" => {
                let patch = if content_type == "application/apply-patch+yaml" {
                    parse_json_or_yaml(body).map_err(bad)?
                } else {
                    serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?
                };
                if !patch.is_object() {
                    return Err(bad("the patch must be a JSON object".into()));
                }
                if content_type == "application/apply-patch+yaml" {
                    if !ctx.force {
                        self.apply_conflicts(key, &old, &patch, status_sub, &ctx.manager)?;
                    }
                    applied = Some(patch.clone());
                } else if let Some(rv) = patch["metadata"]["resourceVersion"].as_str() {
                    if Some(rv) != old["metadata"]["resourceVersion"].as_str() {
                        return Err(obj_err(
                                409,
                                "Conflict",
                                &kind,
                                &key.2,
                                "the object has been modified; please apply your changes to the latest version and try again",
                            ));
                    }
                }
                json_patch::merge(&mut doc, &patch);
            }
            other => {
                return Err(err(
                    415,
                    "UnsupportedMediaType",
                    format!("the body of the request was in an unknown format: {other}"),
                ))
            }
        }
        if applied.is_none() {
            self.strict_patch(key, &doc, ctx)?;
        }
        self.commit_update(key, &old, doc, status_sub, ctx, applied.as_ref())
            .map(|o| (StatusCode::OK, o))
    }

    fn delete(&mut self, key: &Key, opts: &Value, ctx: &Ctx) -> ApiResult<Value> {
        let kind = KINDS[key.0];
        let old = self.get(key)?;
        let pre = &opts["preconditions"];
        for (field, what) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
            if let Some(want) = pre[field].as_str() {
                if Some(want) != old["metadata"][field].as_str() {
                    return Err(obj_err(
                        409,
                        "Conflict",
                        &kind,
                        &key.2,
                        &format!(
                            "Precondition failed: {what} in precondition: {want}, {what} in object meta: {}",
                            old["metadata"][field].as_str().unwrap_or("")
                        ),
                    ));
                }
            }
        }
        if finalizers(&old) > 0 {
            if !old["metadata"]["deletionTimestamp"].is_null() || ctx.dry_run {
                return Ok(old);
            }
            let mut new = old.clone();
            new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            new["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            let rv = self.bump();
            new["metadata"]["resourceVersion"] = json!(rv.to_string());
            self.objects.insert(key.clone(), new.clone());
            self.emit(key.0, "MODIFIED", &new);
            return Ok(new);
        }
        let details = json!({
            "name": key.2,
            "group": kind.group,
            "kind": kind.plural,
            "uid": old["metadata"]["uid"],
        });
        if !ctx.dry_run {
            let mut gone = old.clone();
            let rv = self.bump();
            gone["metadata"]["resourceVersion"] = json!(rv.to_string());
            self.objects.remove(key);
            self.owners.remove(key);
            self.emit(key.0, "DELETED", &gone);
        }
        if !kind.is_custom() {
            // Built-in resources answer with the deleted object.
            Ok(old)
        } else {
            // Custom resources answer with a Success status.
            Ok(json!({
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": details,
            }))
        }
    }

    fn matching(&self, k: usize, filter: &Filter) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((kk, _, _), o)| *kk == k && filter.matches(o))
            .map(|(_, o)| o.clone())
            .collect()
    }

    fn list(&self, k: usize, filter: &Filter, q: &HashMap<String, String>) -> Value {
        let kind = KINDS[k];
        let mut items = self.matching(k, filter);
        let key_of = |o: &Value| {
            format!(
                "{}/{}",
                o["metadata"]["namespace"].as_str().unwrap_or(""),
                o["metadata"]["name"].as_str().unwrap_or("")
            )
        };
        if let Some(token) = q.get("continue").filter(|t| !t.is_empty()) {
            items.retain(|o| key_of(o).as_str() > token.as_str());
        }
        let mut meta = json!({"resourceVersion": self.rv.to_string()});
        if let Some(limit) = q
            .get("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|l| *l > 0)
        {
            if items.len() > limit {
                let rest = items.len() - limit;
                items.truncate(limit);
                meta["continue"] = json!(key_of(items.last().expect("limit > 0")));
                meta["remainingItemCount"] = json!(rest);
            }
        }
        json!({
            "kind": format!("{}List", kind.kind),
            "apiVersion": kind.api_version(),
            "metadata": meta,
            "items": items,
        })
    }

    /// Starts a watch: the events to send first and, unless the watch is answered by a 410,
    /// the channel of live events.
    fn watch(
        &mut self,
        k: usize,
        filter: Filter,
        q: &HashMap<String, String>,
    ) -> (VecDeque<Value>, Option<mpsc::UnboundedReceiver<Value>>) {
        let kind = KINDS[k];
        let rv_param = q.get("resourceVersion").map(String::as_str).unwrap_or("");
        let mut initial = VecDeque::new();
        if rv_param.is_empty() || rv_param == "0" {
            // "Start at most recent / any": the current state as ADDED, then what follows.
            for o in self.matching(k, &filter) {
                initial.push_back(json!({"type": "ADDED", "object": o}));
            }
            if q.get("sendInitialEvents").map(String::as_str) == Some("true") {
                initial.push_back(json!({"type": "BOOKMARK", "object": {
                    "kind": kind.kind,
                    "apiVersion": kind.api_version(),
                    "metadata": {
                        "resourceVersion": self.rv.to_string(),
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                }}));
            }
        } else {
            let from: u64 = match rv_param.parse() {
                Ok(n) => n,
                Err(_) => {
                    let e = err(
                        400,
                        "BadRequest",
                        format!("invalid resource version: {rv_param}"),
                    );
                    initial.push_back(json!({"type": "ERROR", "object": status_body(&e)}));
                    return (initial, None);
                }
            };
            if from < self.compacted {
                let e = err(
                    410,
                    "Expired",
                    format!("too old resource version: {from} ({})", self.rv),
                );
                initial.push_back(json!({"type": "ERROR", "object": status_body(&e)}));
                return (initial, None);
            }
            for h in &self.history {
                if h.kind == k && h.rv > from && filter.matches(&h.event["object"]) {
                    initial.push_back(h.event.clone());
                }
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.watchers.push(Watcher {
            kind: k,
            filter,
            tx,
        });
        (initial, Some(rx))
    }
}

fn escape_pointer(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

/// The fields of an object a field manager can own, as JSON pointers to their values: leaves of
/// everything but `apiVersion`/`kind`, and of `metadata` only labels, annotations, finalizers and
/// ownerReferences. Arrays are leaves.
fn leaves(obj: &Value) -> BTreeMap<String, Value> {
    fn walk(v: &Value, path: String, out: &mut BTreeMap<String, Value>) {
        match v {
            Value::Object(o) if !o.is_empty() => {
                for (k, val) in o {
                    walk(val, format!("{path}/{}", escape_pointer(k)), out);
                }
            }
            _ => {
                out.insert(path, v.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    let Some(o) = obj.as_object() else {
        return out;
    };
    for (k, val) in o {
        match k.as_str() {
            "apiVersion" | "kind" => {}
            "metadata" => {
                for mk in ["labels", "annotations"] {
                    if let Some(m) = val.get(mk).and_then(Value::as_object) {
                        for (lk, lv) in m {
                            out.insert(
                                format!("/metadata/{mk}/{}", escape_pointer(lk)),
                                lv.clone(),
                            );
                        }
                    }
                }
                for mk in ["finalizers", "ownerReferences"] {
                    if let Some(x) = val.get(mk) {
                        out.insert(format!("/metadata/{mk}"), x.clone());
                    }
                }
            }
            _ => walk(val, format!("/{}", escape_pointer(k)), &mut out),
        }
    }
    out
}

fn parse_json_or_yaml(body: &[u8]) -> Result<Value, String> {
    match serde_json::from_slice(body) {
        Ok(v) => Ok(v),
        Err(json_err) => serde_yaml::from_slice(body).map_err(|e| format!("{json_err}; {e}")),
    }
}

/// An in-process fake Kubernetes API server. Dropping it stops accepting connections and ends
/// every open watch.
pub struct FakeApi {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.accept.abort();
        if let Ok(mut s) = self.state.lock() {
            s.watchers.clear();
        }
    }
}

impl FakeApi {
    /// Starts the server on `127.0.0.1:0` (plain HTTP) in the current tokio runtime.
    pub async fn start() -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(&state, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        FakeApi {
            addr,
            state,
            accept,
        }
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client of this server, with default namespace `default`.
    pub fn client(&self) -> kube::Client {
        let uri = self.url().parse().expect("uri");
        kube::Client::try_from(kube::Config::new(uri)).expect("client")
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates or replaces a Secret whose `data` holds these keys (base64), visible to GET, LIST
    /// and watches like any write through the API.
    pub fn put_secret(&self, ns: &str, name: &str, data: &[(&str, &str)]) {
        let k = kind_index("", "v1", "secrets").expect("secrets");
        let b64 = base64::engine::general_purpose::STANDARD;
        let data: Map<String, Value> = data
            .iter()
            .map(|(k, v)| (k.to_string(), json!(b64.encode(v))))
            .collect();
        let body = json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": ns},
            "type": "Opaque",
            "data": data,
        });
        let key: Key = (k, ns.into(), name.into());
        let mut s = self.lock();
        let ctx = Ctx {
            manager: "fake-api".into(),
            ..Ctx::default()
        };
        let res = if s.objects.contains_key(&key) {
            s.update(&key, body, false, &ctx)
        } else {
            s.create(k, ns, body, &ctx)
        };
        if let Err(e) = res {
            panic!("put_secret {ns}/{name}: {}", e.message);
        }
    }

    /// Every Event created so far (events.k8s.io/v1 and core v1), in creation order, each in its
    /// latest stored form (a recorder's series patches show up in it).
    pub fn events(&self) -> Vec<Value> {
        let s = self.lock();
        s.event_keys
            .iter()
            .filter_map(|k| s.event_last.get(k).cloned())
            .collect()
    }

    /// How many PUT/PATCH requests hit `/status` of the object `ns/name` (of any resource),
    /// whether or not they changed anything.
    pub fn status_writes(&self, ns: &str, name: &str) -> usize {
        self.lock()
            .status_writes
            .get(&(ns.to_string(), name.to_string()))
            .copied()
            .unwrap_or(0)
    }

    /// Ends every open watch, and makes a watch from any resourceVersion handed out so far
    /// answer `410 Gone` (an ERROR event), as after an etcd compaction: a `kube::runtime::watcher`
    /// then relists. (The resourceVersion is bumped so that no client holds a current one.)
    pub fn expire_watches(&self) {
        let mut s = self.lock();
        let rv = s.bump();
        s.compacted = rv;
        s.history.clear();
        s.watchers.clear();
    }

    /// The stored object, by plural (`dlqreplays`, `secrets`, `leases`, ...; for `events` the
    /// events.k8s.io one is looked up first), namespace (`""` for cluster-scoped) and name.
    pub fn get_json(&self, plural: &str, ns: &str, name: &str) -> Option<Value> {
        let s = self.lock();
        let mut idx: Vec<usize> = (0..KINDS.len())
            .filter(|i| KINDS[*i].plural == plural)
            .collect();
        idx.sort_by_key(|i| KINDS[*i].group.is_empty());
        idx.into_iter().find_map(|i| {
            let ns = if KINDS[i].namespaced { ns } else { "" };
            s.objects
                .get(&(i, ns.to_string(), name.to_string()))
                .cloned()
        })
    }
}

/// A parsed request path.
struct Route {
    kind: usize,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

fn route(path: &str) -> Result<Route, ApiError> {
    let unknown = || {
        err(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
    };
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(unknown()),
    };
    let (namespace, plural, name, sub) = match rest {
        ["namespaces", ns, plural, tail @ ..]
            if !(tail.is_empty() && (*plural == "status" || *plural == "finalize")) =>
        {
            (Some(ns.to_string()), *plural, tail.first(), tail.get(1))
        }
        [plural, tail @ ..] => (None, *plural, tail.first(), tail.get(1)),
        [] => return Err(unknown()),
    };
    if rest.len() > 5 {
        return Err(unknown());
    }
    let kind = kind_index(group, version, plural).ok_or_else(unknown)?;
    if KINDS[kind].namespaced != namespace.is_some() && name.is_some() {
        return Err(unknown());
    }
    if !KINDS[kind].namespaced && namespace.is_some() {
        return Err(unknown());
    }
    Ok(Route {
        kind,
        namespace,
        name: name.map(|s| s.to_string()),
        subresource: sub.map(|s| s.to_string()),
    })
}

fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed_unsync())
        .expect("response")
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(
        StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &status_body(e),
    )
}

fn watch_response(
    initial: VecDeque<Value>,
    rx: Option<mpsc::UnboundedReceiver<Value>>,
    timeout: Option<Duration>,
) -> Response<Body> {
    struct W {
        initial: VecDeque<Value>,
        rx: Option<mpsc::UnboundedReceiver<Value>>,
        deadline: Option<tokio::time::Instant>,
    }
    let w = W {
        initial,
        rx,
        deadline: timeout.map(|t| tokio::time::Instant::now() + t),
    };
    let frame = |v: Value| -> Result<Frame<Bytes>, Infallible> {
        Ok(Frame::data(Bytes::from(format!("{v}\n"))))
    };
    let stream = futures::stream::unfold(w, move |mut w| async move {
        if let Some(v) = w.initial.pop_front() {
            return Some((frame(v), w));
        }
        let rx = w.rx.as_mut()?;
        let next = match w.deadline {
            Some(d) => tokio::time::timeout_at(d, rx.recv()).await.ok().flatten(),
            None => rx.recv().await,
        };
        next.map(|v| (frame(v), w))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed_unsync(StreamBody::new(stream)))
        .expect("response")
}

async fn handle(state: &Mutex<State>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let q: HashMap<String, String> =
        url::form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes())
            .into_owned()
            .collect();
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    let user_agent = req
        .headers()
        .get("user-agent")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split('/').next())
        .filter(|v| !v.is_empty())
        .map(str::to_string);
    if path == "/version" {
        return json_response(
            StatusCode::OK,
            &json!({"major": "1", "minor": "36", "gitVersion": "v1.36.0-fake", "platform": "linux/amd64"}),
        );
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_response(&err(400, "BadRequest", e.to_string())),
    };
    let r = match route(&path) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    let kind = KINDS[r.kind];
    let ns = r.namespace.clone().unwrap_or_default();
    let ctx = Ctx {
        dry_run: q.contains_key("dryRun"),
        force: q.get("force").map(String::as_str) == Some("true"),
        manager: q
            .get("fieldManager")
            .cloned()
            .or(user_agent)
            .unwrap_or_else(|| "unknown".into()),
        field_validation: q.get("fieldValidation").cloned(),
    };
    let status_sub = match r.subresource.as_deref() {
        None => false,
        Some("status") if kind.status => true,
        Some(_) => {
            return error_response(&err(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ))
        }
    };
    let is_watch = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    let parse_body = || -> ApiResult<Value> {
        serde_json::from_slice(&body)
            .map_err(|e| err(400, "BadRequest", format!("cannot decode the body: {e}")))
    };
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    if status_sub && (method == Method::PUT || method == Method::PATCH) {
        if let Some(name) = &r.name {
            *s.status_writes
                .entry((ns.clone(), name.clone()))
                .or_default() += 1;
        }
    }
    let result: ApiResult<(StatusCode, Value)> = match (&method, &r.name) {
        (&Method::GET, None) if is_watch => {
            let filter = Filter::from_query(r.namespace.clone(), &q);
            let (initial, rx) = s.watch(r.kind, filter, &q);
            let timeout = q
                .get("timeoutSeconds")
                .and_then(|t| t.parse::<u64>().ok())
                .map(Duration::from_secs);
            return watch_response(initial, rx, timeout);
        }
        (&Method::GET, None) => {
            let filter = Filter::from_query(r.namespace.clone(), &q);
            Ok((StatusCode::OK, s.list(r.kind, &filter, &q)))
        }
        (&Method::POST, None) if kind.namespaced && r.namespace.is_none() => Err(err(
            405,
            "MethodNotAllowed",
            "create a namespaced object under /namespaces/{ns}/",
        )),
        (&Method::POST, None) => parse_body()
            .and_then(|b| s.create(r.kind, &ns, b, &ctx))
            .map(|o| (StatusCode::CREATED, o)),
        (&Method::DELETE, None) => {
            let filter = Filter::from_query(r.namespace.clone(), &q);
            let names: Vec<Key> = s
                .matching(r.kind, &filter)
                .iter()
                .map(|o| {
                    (
                        r.kind,
                        o["metadata"]["namespace"]
                            .as_str()
                            .unwrap_or("")
                            .to_string(),
                        o["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect();
            let mut items = Vec::new();
            let mut failed = None;
            for key in names {
                match s.delete(&key, &Value::Null, &ctx) {
                    Ok(o) if o["kind"] != "Status" => items.push(o),
                    Ok(_) => {}
                    Err(e) => failed = Some(e),
                }
            }
            match failed {
                Some(e) => Err(e),
                None => Ok((
                    StatusCode::OK,
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}),
                )),
            }
        }
        (&Method::GET, Some(name)) => s
            .get(&(r.kind, ns.clone(), name.clone()))
            .map(|o| (StatusCode::OK, o)),
        (&Method::PUT, Some(name)) => parse_body()
            .and_then(|b| s.update(&(r.kind, ns.clone(), name.clone()), b, status_sub, &ctx))
            .map(|o| (StatusCode::OK, o)),
        (&Method::PATCH, Some(name)) => s.patch(
            &(r.kind, ns.clone(), name.clone()),
            &content_type,
            &body,
            status_sub,
            &ctx,
        ),
        (&Method::DELETE, Some(name)) => {
            let opts = if body.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&body).unwrap_or(Value::Null)
            };
            s.delete(&(r.kind, ns.clone(), name.clone()), &opts, &ctx)
                .map(|o| (StatusCode::OK, o))
        }
        _ => Err(err(
            405,
            "MethodNotAllowed",
            format!("{method} is not supported here"),
        )),
    };
    let warnings = std::mem::take(&mut s.warnings);
    drop(s);
    let mut response = match result {
        Ok((code, v)) => json_response(code, &v),
        Err(e) => error_response(&e),
    };
    for w in warnings {
        let value = format!("299 - {}", serde_json::Value::String(w));
        if let Ok(v) = hyper::header::HeaderValue::from_str(&value) {
            response.headers_mut().append("warning", v);
        }
    }
    response
}
