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

mod errors;
mod http;
mod kinds;
mod objects;
mod request;
mod schema;
mod state;
mod writes;

use errors::*;
use http::*;
use kinds::*;
use objects::*;
use request::*;
use schema::*;
use state::*;

pub use schema::{committed_crd, crd_before_the_rules};

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
