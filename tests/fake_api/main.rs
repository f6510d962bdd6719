//! Conformance of the fake API server (`crates/testkit/src/fake_api.rs`) with a real one.
//!
//! Every check runs twice: `fake::NAME` against the in-process fake, and `e2e::NAME` against a
//! real cluster when `E2E=1` and `KUBECONFIG` are set (a fresh namespace per test, the CRD from
//! `crds/dlqreplay.yaml` applied first). Without them the `e2e::*` tests print
//! `SKIPPED: E2E=1 and KUBECONFIG not set` and check nothing (with `REQUIRE_KUBE=1`, as `.ci/run`
//! sets, they fail instead). `fake_only::*` covers the fake's own
//! helpers (`put_secret`, `events`, `status_writes`, `get_json`, `expire_watches`) and what a
//! shared cluster cannot be made to show quickly (another CRD installed: ratcheting; a watch
//! expired on demand; streaming lists, which the tests' etcd 3.5.1 cannot serve).
//!
//! The CRD's rules hold on both: a spec change other than `suspend` is refused (the checks that
//! change a spec change `suspend`), and so is every bad spec a real API server once admitted
//! (`messagesPerSecond: 0`, quarantine = source, a key pointer without `/`,
//! `canary.waitSeconds: 0`, both `url` and `urlSecretRef`, ...), with 422 `Invalid` and a cause
//! naming the field.
//!
//! The checks by concern: [`objects`], [`writes`], [`watches`], [`builtins`], [`schema`] (the
//! CRD's rules); the `fake::`/`e2e::` tests are made here, so their names do not change with the
//! module a check lives in.

use std::io::Write as _;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use dlq_replay::api::{DlqReplay, DlqReplayStatus, Phase, ReplayStatus};
use dlq_replay_testkit::cluster::e2e_namespace;
use dlq_replay_testkit::fake_api::FakeApi;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ObjectReference, Secret};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    WatchEvent, WatchParams,
};
use kube::runtime::{finalizer, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::{json, Value};

mod builtins;
mod fake_only;
mod objects;
mod schema;
mod watches;
mod writes;

use builtins::*;
use objects::*;
use schema::*;
use watches::*;
use writes::*;

const MANAGER: &str = "dlq-replay-conformance";
const FINALIZER: &str = "replay.dlq.dev/conformance";

/// Where a check runs: the fake, or a namespace of a real cluster.
struct Env {
    client: Client,
    ns: String,
    fake: Option<FakeApi>,
}

impl Env {
    async fn fake() -> Env {
        let fake = FakeApi::start().await;
        Env {
            client: fake.client(),
            ns: "conformance".into(),
            fake: Some(fake),
        }
    }

    /// A fresh namespace of the cluster `KUBECONFIG` points at, with the CRD applied; `None` (and
    /// a SKIPPED line on stderr) unless `E2E=1` and `KUBECONFIG` are set.
    async fn real(test: &str) -> Option<Env> {
        let (client, ns) = e2e_namespace(test, "dlq-conf").await?;
        Some(Env {
            client,
            ns,
            fake: None,
        })
    }

    fn replays(&self) -> Api<DlqReplay> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Forces `410 Gone` for watches from older versions; `false` where that cannot be done (a
    /// real cluster compacts on its own schedule).
    fn expire_watches(&self) -> bool {
        match &self.fake {
            Some(f) => {
                f.expire_watches();
                true
            }
            None => false,
        }
    }

    /// Removes what a real cluster would keep: our replays (their finalizers dropped), then the
    /// namespace.
    async fn cleanup(&self) {
        if self.fake.is_none() {
            dlq_replay_testkit::cluster::delete_namespace(&self.client, &self.ns).await;
        }
    }
}

/// Polls `f` until it answers `Some`, or `None` after `limit`.
async fn eventually<T, F, Fut>(limit: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= end {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn replay(name: &str, ns: &str) -> DlqReplay {
    let text = format!(
        "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  broker: {{url: \"amqp://guest:guest@127.0.0.1:5672/%2f\"}}\n  source: {{queue: {name}-dlq}}\n  quarantine: {{queue: {name}-quarantine}}\n"
    );
    dlq_replay::manifest::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn rv<K: Resource>(k: &K) -> u64 {
    k.meta()
        .resource_version
        .as_deref()
        .expect("resourceVersion")
        .parse()
        .expect("numeric resourceVersion")
}

fn generation<K: Resource>(k: &K) -> i64 {
    k.meta().generation.expect("generation")
}

fn api_code(e: &kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// The fields an API error's `details.causes` name.
fn causes(e: &kube::Error) -> Vec<String> {
    match e {
        kube::Error::Api(s) => s
            .details
            .iter()
            .flat_map(|d| d.causes.iter())
            .map(|c| c.field.clone())
            .collect(),
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn merge(v: Value) -> Patch<Value> {
    Patch::Merge(v)
}

fn pp() -> PatchParams {
    PatchParams::default()
}

/// A watch event reduced to (type, name, resourceVersion).
fn summarize(e: &WatchEvent<DlqReplay>) -> (String, String, u64) {
    match e {
        WatchEvent::Added(o) => ("ADDED".into(), o.name_any(), rv(o)),
        WatchEvent::Modified(o) => ("MODIFIED".into(), o.name_any(), rv(o)),
        WatchEvent::Deleted(o) => ("DELETED".into(), o.name_any(), rv(o)),
        WatchEvent::Bookmark(b) => (
            "BOOKMARK".into(),
            String::new(),
            b.metadata.resource_version.parse().unwrap_or(0),
        ),
        WatchEvent::Error(s) => (format!("ERROR {}", s.code), String::new(), 0),
    }
}

/// The next `n` non-bookmark events of a watch, within `limit`.
async fn take_events<S>(stream: &mut S, n: usize, limit: Duration) -> Vec<WatchEvent<DlqReplay>>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<DlqReplay>>> + Unpin,
{
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, async {
        while out.len() < n {
            match stream.next().await {
                Some(Ok(WatchEvent::Bookmark(_))) => {}
                Some(Ok(e)) => out.push(e),
                Some(Err(e)) => panic!("watch failed: {e:?}"),
                None => break,
            }
        }
    })
    .await;
    out
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        /// The checks against the in-process fake.
        mod fake {
            $(
                #[tokio::test]
                async fn $name() {
                    let env = super::Env::fake().await;
                    super::$name(&env).await;
                }
            )*
        }

        /// The same checks against a real cluster (E2E=1 and KUBECONFIG), else SKIPPED.
        mod e2e {
            use futures::FutureExt as _;
            $(
                #[tokio::test]
                async fn $name() {
                    let Some(env) = super::Env::real(stringify!($name)).await else {
                        return;
                    };
                    let result = super::AssertUnwindSafe(super::$name(&env)).catch_unwind().await;
                    env.cleanup().await;
                    if let Err(panic) = result {
                        std::panic::resume_unwind(panic);
                    }
                }
            )*
        }
    };
}

conformance!(
    resource_version_grows,
    generation_bumps_only_on_spec_changes,
    status_and_spec_are_separate,
    finalizers_hold_deletion,
    watch_replays_later_changes_in_order,
    expired_watch_relists,
    patches_of_every_kind,
    errors_are_statuses,
    secrets_and_leases,
    server_side_apply_conflicts,
    cluster_wide_list_and_watch,
    events_in_both_groups,
    bad_specs_are_refused_naming_the_field,
    immutable_fields_are_refused_naming_the_field,
    unknown_fields_are_pruned_or_refused,
    defaults_are_applied,
    status_is_validated_against_its_schema,
    pruned_fields_are_warned_about,
    watch_timeout_ends_the_stream,
    delete_of_custom_resource_answers_status_and_watch_sees_deleted,
);
