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

// ---------------------------------------------------------------- checks (fake and real)

async fn resource_version_grows(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("rv-a", &env.ns))
        .await
        .unwrap();
    let rv1 = rv(&a);
    let a2 = api
        .patch(
            "rv-a",
            &pp(),
            &merge(json!({"metadata": {"labels": {"n": "1"}}})),
        )
        .await
        .unwrap();
    let rv2 = rv(&a2);
    assert!(rv2 > rv1, "{rv2} > {rv1}");
    let s: Secret =
        serde_json::from_value(json!({"metadata": {"name": "rv-s"}, "stringData": {"k": "v"}}))
            .unwrap();
    let s = env
        .secrets()
        .create(&PostParams::default(), &s)
        .await
        .unwrap();
    let rv3 = rv(&s);
    assert!(rv3 > rv2, "{rv3} > {rv2}");
    let list = api.list(&ListParams::default()).await.unwrap();
    let list_rv: u64 = list.metadata.resource_version.unwrap().parse().unwrap();
    assert!(list_rv >= rv3, "list {list_rv} >= {rv3}");
    // A read does not bump it; a no-op write neither.
    let got = api.get("rv-a").await.unwrap();
    assert_eq!(rv(&got), rv2);
    let same = api
        .patch(
            "rv-a",
            &pp(),
            &merge(json!({"metadata": {"labels": {"n": "1"}}})),
        )
        .await
        .unwrap();
    assert_eq!(rv(&same), rv2, "a no-op patch keeps the resourceVersion");
    assert!(a.uid().is_some_and(|u| !u.is_empty()), "uid assigned");
    assert!(
        a.meta().creation_timestamp.is_some(),
        "creationTimestamp set"
    );
}

async fn generation_bumps_only_on_spec_changes(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("gen", &env.ns))
        .await
        .unwrap();
    assert_eq!(generation(&a), 1);
    let labelled = api
        .patch(
            "gen",
            &pp(),
            &merge(json!({"metadata": {"labels": {"x": "y"}, "annotations": {"a": "b"}}})),
        )
        .await
        .unwrap();
    assert_eq!(generation(&labelled), 1, "metadata-only change");
    assert!(rv(&labelled) > rv(&a));
    let st = api
        .patch_status(
            "gen",
            &pp(),
            &merge(json!({"status": {"phase": "Draining"}})),
        )
        .await
        .unwrap();
    assert_eq!(generation(&st), 1, "status change");
    let spec = api
        .patch("gen", &pp(), &merge(json!({"spec": {"suspend": true}})))
        .await
        .unwrap();
    assert_eq!(generation(&spec), 2, "spec change");
    assert!(spec.spec.suspend);
    // A replace that keeps the spec keeps the generation.
    let mut again = spec.clone();
    again
        .metadata
        .labels
        .get_or_insert_default()
        .insert("z".into(), "1".into());
    let replaced = api
        .replace("gen", &PostParams::default(), &again)
        .await
        .unwrap();
    assert_eq!(generation(&replaced), 2, "replace without spec change");
    // (`suspend` is the one spec field the CRD lets change.)
    let mut changed = replaced.clone();
    changed.spec.suspend = false;
    let replaced = api
        .replace("gen", &PostParams::default(), &changed)
        .await
        .unwrap();
    assert_eq!(generation(&replaced), 3, "replace with spec change");
    // A spec change the CRD refuses changes nothing, the generation included.
    let mut refused = replaced.clone();
    refused.spec.dry_run = true;
    let e = api
        .replace("gen", &PostParams::default(), &refused)
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(generation(&api.get("gen").await.unwrap()), 3);
}

async fn status_and_spec_are_separate(env: &Env) {
    let api = env.replays();
    let mut with_status = replay("sub", &env.ns);
    with_status.status = Some(DlqReplayStatus::from(ReplayStatus {
        phase: Some(Phase::Done),
        ..Default::default()
    }));
    let created = api
        .create(&PostParams::default(), &with_status)
        .await
        .unwrap();
    assert!(
        created.status.as_ref().and_then(|s| s.phase).is_none(),
        "create ignores .status: {:?}",
        created.status
    );
    // A status patch cannot change spec.
    let st = api
        .patch_status(
            "sub",
            &pp(),
            &merge(
                json!({"spec": {"suspend": true}, "status": {"phase": "Draining", "message": "m"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(st.status.as_ref().unwrap().phase, Some(Phase::Draining));
    assert!(!st.spec.suspend, "status patch changed spec");
    // A spec patch cannot change status.
    let sp = api
        .patch(
            "sub",
            &pp(),
            &merge(json!({"spec": {"suspend": true}, "status": {"phase": "Failed"}})),
        )
        .await
        .unwrap();
    assert!(sp.spec.suspend);
    assert_eq!(
        sp.status.as_ref().unwrap().phase,
        Some(Phase::Draining),
        "spec patch changed status"
    );
    // Same for replace and replace_status.
    let mut body = sp.clone();
    body.spec.suspend = false;
    body.status.as_mut().unwrap().phase = Some(Phase::Done);
    let rs = api
        .replace_status("sub", &PostParams::default(), &body)
        .await
        .unwrap();
    assert_eq!(rs.status.as_ref().unwrap().phase, Some(Phase::Done));
    assert!(rs.spec.suspend, "replace_status changed spec");
    let mut body = rs.clone();
    body.spec.suspend = false;
    body.status.as_mut().unwrap().phase = Some(Phase::Failed);
    let r = api
        .replace("sub", &PostParams::default(), &body)
        .await
        .unwrap();
    assert!(!r.spec.suspend);
    assert_eq!(
        r.status.as_ref().unwrap().phase,
        Some(Phase::Done),
        "replace changed status"
    );
    let got = api.get_status("sub").await.unwrap();
    assert_eq!(got.status.unwrap().phase, Some(Phase::Done));
}

async fn finalizers_hold_deletion(env: &Env) {
    let api = env.replays();
    let mut r = replay("fin", &env.ns);
    r.metadata.finalizers = Some(vec![FINALIZER.into()]);
    api.create(&PostParams::default(), &r).await.unwrap();
    let deleted = api.delete("fin", &DeleteParams::default()).await.unwrap();
    let held = deleted
        .left()
        .expect("object kept while a finalizer is on it");
    assert!(held.meta().deletion_timestamp.is_some());
    let got = api.get("fin").await.unwrap();
    assert!(
        got.meta().deletion_timestamp.is_some(),
        "deletionTimestamp set"
    );
    assert_eq!(got.finalizers(), [FINALIZER.to_string()]);
    // A failed JSON-patch test is refused, and nothing changes.
    let wrong: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "someone-else"},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]))
    .unwrap();
    let e = api
        .patch("fin", &pp(), &Patch::Json::<()>(wrong))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(api.get("fin").await.unwrap().finalizers().len(), 1);
    // Removing the last finalizer lets the deletion finish.
    let remove: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": FINALIZER},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]))
    .unwrap();
    api.patch("fin", &pp(), &Patch::Json::<()>(remove))
        .await
        .unwrap();
    let gone = eventually(Duration::from_secs(20), || async {
        api.get_opt("fin").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "object still there after its last finalizer went"
    );

    // kube's finalizer helper: adds its finalizer (JSON patch testing a missing path for null),
    // then on deletion runs cleanup and removes it.
    api.create(&PostParams::default(), &replay("helper", &env.ns))
        .await
        .unwrap();
    let obj = Arc::new(api.get("helper").await.unwrap());
    finalizer(&api, FINALIZER, obj, |_| async {
        Ok::<_, std::io::Error>(kube::runtime::controller::Action::await_change())
    })
    .await
    .expect("finalizer added");
    let obj = api.get("helper").await.unwrap();
    assert_eq!(obj.finalizers(), [FINALIZER.to_string()]);
    api.delete("helper", &DeleteParams::default())
        .await
        .unwrap();
    let obj = Arc::new(api.get("helper").await.unwrap());
    assert!(obj.meta().deletion_timestamp.is_some());
    let mut cleaned = false;
    finalizer(&api, FINALIZER, obj, |ev| {
        cleaned = matches!(ev, finalizer::Event::Cleanup(_));
        async { Ok::<_, std::io::Error>(kube::runtime::controller::Action::await_change()) }
    })
    .await
    .expect("finalizer removed");
    assert!(cleaned, "cleanup ran");
    let gone = eventually(Duration::from_secs(20), || async {
        api.get_opt("helper").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(gone.is_some(), "helper's object still there after cleanup");
}

async fn watch_replays_later_changes_in_order(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("wa", &env.ns))
        .await
        .unwrap();
    let from = a.resource_version().unwrap();
    api.patch(
        "wa",
        &pp(),
        &merge(json!({"metadata": {"labels": {"step": "1"}}})),
    )
    .await
    .unwrap();
    api.create(&PostParams::default(), &replay("wb", &env.ns))
        .await
        .unwrap();
    api.patch_status("wa", &pp(), &merge(json!({"status": {"phase": "Canary"}})))
        .await
        .unwrap();
    api.delete("wb", &DeleteParams::default()).await.unwrap();

    let wp = WatchParams::default().timeout(20);
    let mut stream = api.watch(&wp, &from).await.unwrap().boxed();
    let events = take_events(&mut stream, 4, Duration::from_secs(15)).await;
    let got: Vec<(String, String)> = events
        .iter()
        .map(summarize)
        .map(|(t, n, _)| (t, n))
        .collect();
    let want: Vec<(String, String)> = [
        ("MODIFIED", "wa"),
        ("ADDED", "wb"),
        ("MODIFIED", "wa"),
        ("DELETED", "wb"),
    ]
    .iter()
    .map(|(t, n)| (t.to_string(), n.to_string()))
    .collect();
    assert_eq!(got, want);
    let rvs: Vec<u64> = events.iter().map(|e| summarize(e).2).collect();
    assert!(rvs.windows(2).all(|w| w[0] < w[1]), "{rvs:?}");
    assert!(rvs[0] > from.parse::<u64>().unwrap());
    if let WatchEvent::Modified(o) = &events[2] {
        assert_eq!(o.status.as_ref().unwrap().phase, Some(Phase::Canary));
    }
    // Then live changes.
    api.create(&PostParams::default(), &replay("wc", &env.ns))
        .await
        .unwrap();
    let live = take_events(&mut stream, 1, Duration::from_secs(15)).await;
    assert_eq!(
        live.iter().map(|e| summarize(e).0).collect::<Vec<_>>(),
        ["ADDED"]
    );
    assert_eq!(summarize(&live[0]).1, "wc");

    // A single-object watch (metadata.name field selector) sees only that object.
    let wp = WatchParams::default()
        .fields("metadata.name=wa")
        .timeout(20);
    let mut one = api.watch(&wp, &from).await.unwrap().boxed();
    let events = take_events(&mut one, 2, Duration::from_secs(15)).await;
    assert_eq!(
        events
            .iter()
            .map(summarize)
            .map(|(t, n, _)| (t, n))
            .collect::<Vec<_>>(),
        vec![
            ("MODIFIED".to_string(), "wa".to_string()),
            ("MODIFIED".into(), "wa".into())
        ]
    );
    api.patch(
        "wc",
        &pp(),
        &merge(json!({"metadata": {"labels": {"other": "1"}}})),
    )
    .await
    .unwrap();
    api.patch(
        "wa",
        &pp(),
        &merge(json!({"metadata": {"labels": {"step": "2"}}})),
    )
    .await
    .unwrap();
    let next = take_events(&mut one, 1, Duration::from_secs(15)).await;
    assert_eq!(
        summarize(&next[0]).1,
        "wa",
        "field selector let another object through"
    );
}

async fn expired_watch_relists(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("exp", &env.ns))
        .await
        .unwrap();
    let old = a.resource_version().unwrap();

    // An open watch, to be ended by the expiry.
    let mut open = api
        .watch(&WatchParams::default().timeout(60), &old)
        .await
        .unwrap()
        .boxed();

    // A watcher that has listed.
    let mut w = watcher(api.clone(), watcher::Config::default()).boxed();
    let mut inits = 0;
    let seen_init = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(ev) = w.next().await {
            match ev {
                Ok(watcher::Event::Init) => inits += 1,
                Ok(watcher::Event::InitDone) => return,
                _ => {}
            }
        }
    })
    .await;
    assert!(seen_init.is_ok(), "watcher did not finish its initial list");

    let expired = env.expire_watches();
    if expired {
        // The open watch ends.
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(Ok(_)) = open.next().await {}
        })
        .await;
        assert!(ended.is_ok(), "open watch did not end on expiry");
        // A watch from before the expiry answers 410 Gone.
        let first = match api.watch(&WatchParams::default().timeout(10), &old).await {
            Ok(s) => s.boxed().try_next().await,
            Err(e) => Err(e),
        };
        match first {
            Ok(Some(WatchEvent::Error(s))) => assert_eq!(s.code, 410, "{s:?}"),
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 410, "{s:?}"),
            other => panic!("expected 410 Gone, got {other:?}"),
        }
    } else {
        let _ = writeln!(
            std::io::stderr(),
            "note: a real cluster cannot be made to expire watches on demand; checking only that the watcher follows later changes"
        );
    }
    drop(open);

    api.patch(
        "exp",
        &pp(),
        &merge(json!({"metadata": {"labels": {"v": "2"}}})),
    )
    .await
    .unwrap();
    let label = |o: &DlqReplay| o.labels().get("v").cloned();
    let saw_v2 = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(ev) = w.next().await {
            match ev {
                Ok(watcher::Event::Init) => inits += 1,
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))
                    if label(&o).as_deref() == Some("2") =>
                {
                    return;
                }
                _ => {}
            }
        }
    })
    .await;
    assert!(
        saw_v2.is_ok(),
        "watcher did not see the change after expiry"
    );
    if expired {
        assert!(
            inits >= 2,
            "watcher did not relist after 410 (inits = {inits})"
        );
    }
    // And it keeps following live changes.
    api.patch(
        "exp",
        &pp(),
        &merge(json!({"metadata": {"labels": {"v": "3"}}})),
    )
    .await
    .unwrap();
    let saw_v3 = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(ev) = w.next().await {
            if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev {
                if label(&o).as_deref() == Some("3") {
                    return;
                }
            }
        }
    })
    .await;
    assert!(
        saw_v3.is_ok(),
        "watcher did not follow live changes after the relist"
    );
}

async fn patches_of_every_kind(env: &Env) {
    let api = env.replays();
    api.create(&PostParams::default(), &replay("p", &env.ns))
        .await
        .unwrap();
    // Merge patch (RFC 7386): set, then null removes.
    let m = api
        .patch(
            "p",
            &pp(),
            &merge(json!({"metadata": {"labels": {"a": "1", "b": "2"}}})),
        )
        .await
        .unwrap();
    assert_eq!(m.labels().get("a").map(String::as_str), Some("1"));
    let m = api
        .patch(
            "p",
            &pp(),
            &merge(json!({"metadata": {"labels": {"a": null}}})),
        )
        .await
        .unwrap();
    assert!(!m.labels().contains_key("a"));
    assert_eq!(m.labels().get("b").map(String::as_str), Some("2"));
    // JSON patch (RFC 6902) with a passing test op.
    let jp: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/source/queue", "value": "p-dlq"},
        {"op": "replace", "path": "/spec/suspend", "value": true},
        {"op": "add", "path": "/metadata/annotations", "value": {"k": "v"}},
    ]))
    .unwrap();
    let j = api.patch("p", &pp(), &Patch::Json::<()>(jp)).await.unwrap();
    assert!(j.spec.suspend);
    assert_eq!(j.annotations().get("k").map(String::as_str), Some("v"));
    // A JSON patch the CRD refuses (the source queue is immutable) changes nothing.
    let jp: json_patch::Patch = serde_json::from_value(json!([
        {"op": "replace", "path": "/spec/source/queue", "value": "p-dlq-2"},
        {"op": "add", "path": "/metadata/annotations/k2", "value": "v2"},
    ]))
    .unwrap();
    let e = api
        .patch("p", &pp(), &Patch::Json::<()>(jp))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["spec.source"], "{e:?}");
    let unchanged = api.get("p").await.unwrap();
    assert_eq!(unchanged.spec.source.queue, "p-dlq");
    assert!(!unchanged.annotations().contains_key("k2"));
    // Merge patch with a stale resourceVersion conflicts.
    let e = api
        .patch(
            "p",
            &pp(),
            &merge(json!({"metadata": {"resourceVersion": "1", "labels": {"c": "3"}}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 409, "{e:?}");
    // Server-side apply: the given fields change, the rest stay.
    let ap = api
        .patch(
            "p",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "metadata": {"name": "p", "labels": {"applied": "yes"}},
                "spec": {"suspend": false},
            })),
        )
        .await
        .unwrap();
    assert_eq!(ap.labels().get("applied").map(String::as_str), Some("yes"));
    assert!(!ap.spec.suspend);
    assert_eq!(ap.spec.source.queue, "p-dlq");
    // Apply creates an absent object.
    let fresh = serde_json::to_value(replay("p-new", &env.ns)).unwrap();
    let created = api
        .patch(
            "p-new",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(fresh),
        )
        .await
        .unwrap();
    assert_eq!(created.spec.source.queue, "p-new-dlq");
    assert_eq!(generation(&created), 1);
    // Apply to /status.
    let st = api
        .patch_status(
            "p",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "metadata": {"name": "p"},
                "status": {"phase": "Pending"},
            })),
        )
        .await
        .unwrap();
    assert_eq!(st.status.unwrap().phase, Some(Phase::Pending));
    // Strategic merge on a built-in resource (Secret).
    let s: Secret =
        serde_json::from_value(json!({"metadata": {"name": "p-s"}, "stringData": {"a": "1"}}))
            .unwrap();
    env.secrets()
        .create(&PostParams::default(), &s)
        .await
        .unwrap();
    let s = env
        .secrets()
        .patch(
            "p-s",
            &pp(),
            &Patch::Strategic(json!({"stringData": {"b": "2"}})),
        )
        .await
        .unwrap();
    let data = s.data.unwrap();
    assert_eq!(data["a"].0, b"1");
    assert_eq!(data["b"].0, b"2");
}

async fn errors_are_statuses(env: &Env) {
    let api = env.replays();
    let e = api.get("missing").await.unwrap_err();
    assert_eq!(api_code(&e), (404, "NotFound".into()));
    assert!(api.get_opt("missing").await.unwrap().is_none());
    let e = api
        .patch("missing", &pp(), &merge(json!({"spec": {"suspend": true}})))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 404);
    let e = api
        .delete("missing", &DeleteParams::default())
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 404);
    let created = api
        .create(&PostParams::default(), &replay("dup", &env.ns))
        .await
        .unwrap();
    let e = api
        .create(&PostParams::default(), &replay("dup", &env.ns))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (409, "AlreadyExists".into()));
    // Optimistic concurrency on replace.
    let mut first = created.clone();
    first.spec.suspend = true;
    let updated = api
        .replace("dup", &PostParams::default(), &first)
        .await
        .unwrap();
    let mut stale = created.clone();
    stale.spec.suspend = false;
    stale
        .metadata
        .labels
        .get_or_insert_default()
        .insert("late".into(), "1".into());
    let e = api
        .replace("dup", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (409, "Conflict".into()));
    let mut current = updated.clone();
    current
        .metadata
        .labels
        .get_or_insert_default()
        .insert("late".into(), "1".into());
    let ok = api
        .replace("dup", &PostParams::default(), &current)
        .await
        .unwrap();
    assert!(ok.spec.suspend && ok.labels().contains_key("late"));
    // A delete without finalizers removes the object.
    api.delete("dup", &DeleteParams::default()).await.unwrap();
    let gone = eventually(Duration::from_secs(20), || async {
        api.get_opt("dup").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(gone.is_some());
}

async fn secrets_and_leases(env: &Env) {
    let secrets = env.secrets();
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": "creds", "labels": {"app": "dlq"}},
        "stringData": {"url": "amqp://u:p@h:5672/%2f"},
    }))
    .unwrap();
    secrets.create(&PostParams::default(), &s).await.unwrap();
    let got = secrets.get("creds").await.unwrap();
    assert_eq!(
        got.data.as_ref().unwrap()["url"].0,
        b"amqp://u:p@h:5672/%2f"
    );
    assert!(got.string_data.is_none(), "stringData is folded into data");
    let listed = secrets
        .list(&ListParams::default().labels("app=dlq"))
        .await
        .unwrap();
    assert_eq!(
        listed
            .items
            .iter()
            .map(|s| s.name_any())
            .collect::<Vec<_>>(),
        ["creds"]
    );
    let none = secrets
        .list(&ListParams::default().labels("app=other"))
        .await
        .unwrap();
    assert!(none.items.is_empty());

    let leases = env.leases();
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "leader"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15},
    }))
    .unwrap();
    let l1 = leases.create(&PostParams::default(), &lease).await.unwrap();
    let mut take = l1.clone();
    take.spec.as_mut().unwrap().holder_identity = Some("b".into());
    let l2 = leases
        .replace("leader", &PostParams::default(), &take)
        .await
        .unwrap();
    assert_eq!(
        l2.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("b")
    );
    let mut late = l1.clone();
    late.spec.as_mut().unwrap().holder_identity = Some("c".into());
    let e = leases
        .replace("leader", &PostParams::default(), &late)
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 409, "a stale lease update must conflict");
}

async fn server_side_apply_conflicts(env: &Env) {
    let leases = env.leases();
    let lease: Lease =
        serde_json::from_value(json!({"metadata": {"name": "ssa"}, "spec": {}})).unwrap();
    leases.create(&PostParams::default(), &lease).await.unwrap();
    let holder = |who: &str| {
        Patch::Apply(json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "ssa"},
            "spec": {"holderIdentity": who, "leaseDurationSeconds": 15},
        }))
    };
    let a = leases
        .patch("ssa", &PatchParams::apply("manager-a"), &holder("a"))
        .await
        .unwrap();
    assert_eq!(a.spec.unwrap().holder_identity.as_deref(), Some("a"));
    // Another manager setting a field owned by manager-a to another value conflicts.
    let e = leases
        .patch("ssa", &PatchParams::apply("manager-b"), &holder("b"))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (409, "Conflict".into()), "{e:?}");
    // One `FieldManagerConflict` cause per field, naming the owner.
    assert_eq!(causes(&e), [".spec.holderIdentity"], "{e:?}");
    let kube::Error::Api(s) = &e else {
        unreachable!()
    };
    let cause = &s.details.as_ref().unwrap().causes[0];
    assert_eq!(
        (cause.reason.as_str(), cause.message.as_str()),
        ("FieldManagerConflict", r#"conflict with "manager-a""#),
        "{e:?}"
    );
    let now = leases.get("ssa").await.unwrap();
    assert_eq!(now.spec.unwrap().holder_identity.as_deref(), Some("a"));
    // The same manager may change its own fields; forcing takes the fields over.
    leases
        .patch("ssa", &PatchParams::apply("manager-a"), &holder("a2"))
        .await
        .unwrap();
    let b = leases
        .patch(
            "ssa",
            &PatchParams::apply("manager-b").force(),
            &holder("b"),
        )
        .await
        .unwrap();
    assert_eq!(b.spec.unwrap().holder_identity.as_deref(), Some("b"));
    let e = leases
        .patch("ssa", &PatchParams::apply("manager-a"), &holder("a3"))
        .await
        .unwrap_err();
    assert_eq!(
        api_code(&e).0,
        409,
        "manager-a lost the field to the forced apply"
    );
    // Merge patches never conflict.
    let m = leases
        .patch(
            "ssa",
            &PatchParams::default(),
            &merge(json!({"spec": {"holderIdentity": null}})),
        )
        .await
        .unwrap();
    assert!(m.spec.unwrap().holder_identity.is_none());
    // Once the field is gone, anyone may apply it.
    leases
        .patch("ssa", &PatchParams::apply("manager-a"), &holder("a4"))
        .await
        .unwrap();
}

async fn cluster_wide_list_and_watch(env: &Env) {
    let ns_api = env.replays();
    let all: Api<DlqReplay> = Api::all(env.client.clone());
    let a = ns_api
        .create(&PostParams::default(), &replay("cw", &env.ns))
        .await
        .unwrap();
    let list = all.list(&ListParams::default()).await.unwrap();
    assert!(list
        .items
        .iter()
        .any(|r| r.name_any() == "cw" && r.namespace().as_deref() == Some(env.ns.as_str())));
    let from = a.resource_version().unwrap();
    let wp = WatchParams::default()
        .fields(&format!("metadata.namespace={}", env.ns))
        .timeout(20);
    let mut stream = all.watch(&wp, &from).await.unwrap().boxed();
    ns_api
        .patch(
            "cw",
            &pp(),
            &merge(json!({"metadata": {"labels": {"w": "1"}}})),
        )
        .await
        .unwrap();
    let events = take_events(&mut stream, 1, Duration::from_secs(15)).await;
    assert_eq!(
        events
            .iter()
            .map(summarize)
            .map(|(t, n, _)| (t, n))
            .collect::<Vec<_>>(),
        vec![("MODIFIED".to_string(), "cw".to_string())]
    );
}

async fn events_in_both_groups(env: &Env) {
    let api = env.replays();
    let r = api
        .create(&PostParams::default(), &replay("ev", &env.ns))
        .await
        .unwrap();
    let reference: ObjectReference = r.object_ref(&());
    let recorder =
        kube::runtime::events::Recorder::new(env.client.clone(), "dlq-replay-conformance".into());
    recorder
        .publish(
            &kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Normal,
                reason: "Started".into(),
                note: Some("replay started".into()),
                action: "Replay".into(),
                secondary: None,
            },
            &reference,
        )
        .await
        .expect("publish events.k8s.io/v1 event");
    let core: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
        "metadata": {"name": "ev.core"},
        "involvedObject": serde_json::to_value(&reference).unwrap(),
        "reason": "Legacy",
        "message": "core v1 event",
        "type": "Normal",
        "source": {"component": "dlq-replay-conformance"},
    }))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::Event>::namespaced(env.client.clone(), &env.ns)
        .create(&PostParams::default(), &core)
        .await
        .expect("create core v1 event");
    let new_events =
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(env.client.clone(), &env.ns)
            .list(&ListParams::default())
            .await
            .unwrap();
    assert!(
        new_events
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("Started")),
        "events.k8s.io/v1 event listed"
    );
    if let Some(fake) = &env.fake {
        let events = fake.events();
        let reasons: Vec<&str> = events.iter().filter_map(|e| e["reason"].as_str()).collect();
        assert_eq!(reasons, ["Started", "Legacy"], "{events:#?}");
        assert_eq!(events[0]["apiVersion"], "events.k8s.io/v1");
        assert_eq!(events[1]["apiVersion"], "v1");
        assert_eq!(events[0]["regarding"]["name"], "ev");
        assert_eq!(events[1]["involvedObject"]["name"], "ev");
    }
}

// ---------------------------------------------------------------- the CRD's rules (fake and real)

/// The replays as raw JSON: what the CLI (and so the typed `replay`) refuses can still be sent.
fn raw_replays(env: &Env) -> Api<DynamicObject> {
    Api::namespaced_with(
        env.client.clone(),
        &env.ns,
        &ApiResource::erase::<DlqReplay>(&()),
    )
}

/// A minimal valid replay as JSON, with `spec` merged into its spec (RFC 7386).
fn raw_replay(name: &str, spec: Value) -> DynamicObject {
    let mut obj = json!({
        "apiVersion": "replay.dlq.dev/v1alpha1",
        "kind": "DlqReplay",
        "metadata": {"name": name},
        "spec": {
            "broker": {"url": "amqp://guest:guest@127.0.0.1:5672/%2f"},
            "source": {"queue": format!("{name}-dlq")},
            "quarantine": {"queue": format!("{name}-quarantine")},
        },
    });
    json_patch::merge(&mut obj["spec"], &spec);
    serde_json::from_value(obj).expect("a DynamicObject")
}

/// The specs a real API server admitted before the CRD carried the rules, each refused now with
/// 422 naming its field, and not stored. The message never repeats the URL's password.
async fn bad_specs_are_refused_naming_the_field(env: &Env) {
    let api = raw_replays(env);
    let redis = json!({"url": "redis://127.0.0.1:6379/0"});
    let cases = [
        (
            "rate-zero",
            json!({"rate": {"messagesPerSecond": 0}}),
            "spec.rate.messagesPerSecond",
        ),
        (
            "same-queue",
            json!({"quarantine": {"queue": "same-queue-dlq"}}),
            "spec.quarantine.queue",
        ),
        (
            "no-slash",
            json!({"idempotency": {"redis": redis, "key": {"fields": [{"pointer": "asset_id"}]}}}),
            "spec.idempotency.key.fields[0].pointer",
        ),
        (
            "wait-zero",
            json!({"canary": {"waitSeconds": 0}}),
            "spec.canary.waitSeconds",
        ),
        (
            "both-urls",
            json!({"broker": {"url": "amqp://guest:s3cr3t-pw@127.0.0.1:5672/%2f", "urlSecretRef": {"name": "rabbitmq", "key": "url"}}}),
            "spec.broker",
        ),
        (
            "no-broker-url",
            json!({"broker": {"url": null}}),
            "spec.broker",
        ),
        (
            "http-url",
            json!({"broker": {"url": "http://guest:s3cr3t-pw@127.0.0.1:5672/"}}),
            "spec.broker.url",
        ),
        (
            "burst-zero",
            json!({"rate": {"messagesPerSecond": 10, "burst": 0}}),
            "spec.rate.burst",
        ),
        (
            "payload-without-condition",
            json!({"selector": {"payload": [{"pointer": "/show"}]}}),
            "spec.selector.payload[0]",
        ),
        (
            "require-done-in-claim-mode",
            json!({"idempotency": {"redis": redis, "mode": "Claim", "key": {"fields": [{"pointer": "/id"}]}}, "canary": {"requireDone": true}}),
            "spec.canary.requireDone",
        ),
    ];
    for (name, spec, field) in cases {
        let e = api
            .create(&PostParams::default(), &raw_replay(name, spec))
            .await
            .expect_err(name);
        assert_eq!(api_code(&e), (422, "Invalid".into()), "{name}: {e:?}");
        assert!(causes(&e).iter().any(|c| c == field), "{name}: {e:?}");
        let kube::Error::Api(status) = &e else {
            unreachable!()
        };
        assert!(
            status.message.contains(field) && !status.message.contains("s3cr3t-pw"),
            "{name}: {}",
            status.message
        );
        assert!(api.get_opt(name).await.unwrap().is_none(), "{name} stored");
    }
}

/// Every spec field but `suspend` is fixed once the replay exists: a change of one, by any kind
/// of write, is refused with 422 naming it (`FieldValueForbidden`), and nothing changes.
async fn immutable_fields_are_refused_naming_the_field(env: &Env) {
    let api = env.replays();
    let created = api
        .create(&PostParams::default(), &replay("imm", &env.ns))
        .await
        .unwrap();
    let forbidden = |e: &kube::Error, field: &str| {
        assert_eq!(api_code(e), (422, "Invalid".into()), "{e:?}");
        let kube::Error::Api(s) = e else {
            unreachable!()
        };
        let cause = s
            .details
            .iter()
            .flat_map(|d| d.causes.iter())
            .find(|c| c.field == field)
            .unwrap_or_else(|| panic!("no cause for {field}: {e:?}"));
        assert_eq!(cause.reason, "FieldValueForbidden", "{e:?}");
    };
    let changes = [
        (
            json!({"spec": {"source": {"queue": "other"}}}),
            "spec.source",
        ),
        (json!({"spec": {"dryRun": true}}), "spec.dryRun"),
        (
            json!({"spec": {"rate": {"messagesPerSecond": 10}}}),
            "spec.rate",
        ),
        (
            json!({"spec": {"canary": {"waitSeconds": 60}}}),
            "spec.canary",
        ),
    ];
    for (patch, field) in changes {
        let e = api.patch("imm", &pp(), &merge(patch)).await.unwrap_err();
        forbidden(&e, field);
    }
    let mut replaced = created.clone();
    replaced.spec.quarantine.queue = "other-quarantine".into();
    let e = api
        .replace("imm", &PostParams::default(), &replaced)
        .await
        .unwrap_err();
    forbidden(&e, "spec.quarantine");
    let e = api
        .patch(
            "imm",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "metadata": {"name": "imm"},
                "spec": {"broker": {"url": "amqp://guest:guest@127.0.0.1:5673/%2f"}},
            })),
        )
        .await
        .unwrap_err();
    forbidden(&e, "spec.broker");
    let now = api.get("imm").await.unwrap();
    assert_eq!(now.spec, created.spec, "a refused write changed the spec");
    assert_eq!(generation(&now), 1);
    // `suspend` may change.
    let suspended = api
        .patch("imm", &pp(), &merge(json!({"spec": {"suspend": true}})))
        .await
        .unwrap();
    assert!(suspended.spec.suspend);
    assert_eq!(generation(&suspended), 2);
}

/// Fields the schema does not know are pruned (the default `fieldValidation=Warn`), refused under
/// `fieldValidation=Strict` (a create with 400 `BadRequest`; a merge patch with 422 `Invalid`, one
/// cause, field `patch`: kube-apiserver decodes the patched object strictly), and fail a
/// server-side apply.
async fn unknown_fields_are_pruned_or_refused(env: &Env) {
    let api = raw_replays(env);
    let created = api
        .create(
            &PostParams::default(),
            &raw_replay("unk", json!({"bogus": 1, "source": {"extra": "x"}})),
        )
        .await
        .unwrap();
    let spec = &created.data["spec"];
    assert!(spec.get("bogus").is_none(), "{spec}");
    assert_eq!(spec["source"], json!({"queue": "unk-dlq"}));
    let stored = api.get("unk").await.unwrap();
    assert!(stored.data["spec"].get("bogus").is_none());
    // A merge patch: pruned, so no spec change (the generation stays).
    let patched = api
        .patch("unk", &pp(), &merge(json!({"spec": {"bogus": 2}})))
        .await
        .unwrap();
    assert!(patched.data["spec"].get("bogus").is_none());
    assert_eq!(patched.metadata.generation, Some(1));
    // Strict: a create is refused with 400, naming every unknown field...
    let body = serde_json::to_vec(&raw_replay(
        "unk-strict",
        json!({"bogus": 1, "source": {"extra": "x"}}),
    ))
    .unwrap();
    let request = hyper::Request::post(format!(
        "/apis/replay.dlq.dev/v1alpha1/namespaces/{}/dlqreplays?fieldValidation=Strict",
        env.ns
    ))
    .header("content-type", "application/json")
    .body(body)
    .unwrap();
    let e = env
        .client
        .request::<DynamicObject>(request)
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (400, "BadRequest".into()), "{e:?}");
    let kube::Error::Api(s) = &e else {
        unreachable!()
    };
    assert!(
        s.message.ends_with(
            r#"strict decoding error: unknown field "spec.bogus", unknown field "spec.source.extra""#
        ),
        "{}",
        s.message
    );
    assert!(api.get_opt("unk-strict").await.unwrap().is_none());
    // ...and a merge patch with 422 `Invalid`, one cause (field `patch`) naming the field.
    let e = api
        .patch(
            "unk",
            &PatchParams::default().validation_strict(),
            &merge(json!({"spec": {"bogus": 3}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["patch"], "{e:?}");
    let kube::Error::Api(s) = &e else {
        unreachable!()
    };
    let cause = &s.details.as_ref().unwrap().causes[0];
    assert_eq!(cause.reason, "FieldValueInvalid", "{e:?}");
    assert!(
        cause
            .message
            .ends_with(r#"strict decoding error: unknown field "spec.bogus""#),
        "{}",
        cause.message
    );
    assert!(
        s.message
            .starts_with(r#" "" is invalid: patch: Invalid value: "#),
        "{}",
        s.message
    );
    // The same on /status, for an unknown field of the status.
    let e = api
        .patch_status(
            "unk",
            &PatchParams::default().validation_strict(),
            &merge(json!({"status": {"bogus": 1}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["patch"], "{e:?}");
    let stored = api.get("unk").await.unwrap();
    assert_eq!(stored.metadata.generation, Some(1));
    assert!(stored.data["spec"].get("bogus").is_none());
    // Server-side apply types the patch with the schema: an undeclared field fails it
    // (kube-apiserver v1.36 answers 500).
    let e = api
        .patch(
            "unk",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "metadata": {"name": "unk"},
                "spec": {"bogus": 4},
            })),
        )
        .await
        .unwrap_err();
    let kube::Error::Api(s) = &e else {
        panic!("{e:?}")
    };
    assert!(s.code == 500 || s.code == 400, "{e:?}");
    assert!(
        s.message
            .contains(".spec.bogus: field not declared in schema"),
        "{}",
        s.message
    );
}

/// The API server fills in the schema's defaults: the spec's on create, the status's on a
/// status write.
async fn defaults_are_applied(env: &Env) {
    let api = raw_replays(env);
    let created = api
        .create(&PostParams::default(), &raw_replay("dft", json!({})))
        .await
        .unwrap();
    let spec = &created.data["spec"];
    assert_eq!(spec["canary"]["waitSeconds"], 120, "{spec}");
    assert_eq!(spec["canary"]["enabled"], true, "{spec}");
    assert_eq!(spec["dryRun"], false, "{spec}");
    assert_eq!(spec["suspend"], false, "{spec}");
    assert_eq!(spec["selector"], json!({}), "{spec}");
    let st = api
        .patch_status(
            "dft",
            &pp(),
            &merge(json!({"status": {"phase": "Pending"}})),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"]["counts"]["scanned"], 0, "{}", st.data);
}

/// Writes to `/status` are checked against the status schema. A schema error of the kinds that
/// keep kube-apiserver from evaluating the CEL rules (a value outside the enum, a missing required
/// field, a wrong type, too long, too many) adds a cause with field `<nil>` saying so; one that
/// does not (a bound) does not.
async fn status_is_validated_against_its_schema(env: &Env) {
    const NOT_CHECKED: &str = "Invalid value: null: some validation rules were not checked because the object was invalid; correct the existing errors to complete validation";
    let not_checked = |e: &kube::Error| {
        let kube::Error::Api(s) = e else {
            panic!("{e:?}")
        };
        let cause = s
            .details
            .iter()
            .flat_map(|d| d.causes.iter())
            .find(|c| c.field == "<nil>")
            .unwrap_or_else(|| panic!("no <nil> cause: {e:?}"));
        assert_eq!(
            (cause.reason.as_str(), cause.message.as_str()),
            ("FieldValueInvalid", NOT_CHECKED),
            "{e:?}"
        );
        assert!(
            s.message.ends_with(&format!("<nil>: {NOT_CHECKED}]")),
            "{}",
            s.message
        );
    };
    let api = env.replays();
    api.create(&PostParams::default(), &replay("sts", &env.ns))
        .await
        .unwrap();
    let e = api
        .patch_status("sts", &pp(), &merge(json!({"status": {"phase": "Bogus"}})))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["status.phase", "<nil>"], "{e:?}");
    let kube::Error::Api(s) = &e else {
        unreachable!()
    };
    assert_eq!(
        s.details.as_ref().unwrap().causes[0].reason,
        "FieldValueNotSupported",
        "{e:?}"
    );
    not_checked(&e);
    // A partial `counts` replaces the default: the counts it lacks are missing (blocking).
    let e = api
        .patch_status(
            "sts",
            &pp(),
            &merge(json!({"status": {"counts": {"scanned": -1}}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    let mut got = causes(&e);
    got.sort();
    assert_eq!(
        got,
        [
            "<nil>",
            "status.counts.duplicates",
            "status.counts.failed",
            "status.counts.quarantined",
            "status.counts.replayed",
            "status.counts.scanned",
            "status.counts.skipped",
        ],
        "{e:?}"
    );
    not_checked(&e);
    // Only a bound broken: the rules were checked, no `<nil>` cause.
    let counts = json!({"scanned": -1, "replayed": 0, "duplicates": 0, "quarantined": 0,
        "failed": 0, "skipped": 0});
    let e = api
        .patch_status("sts", &pp(), &merge(json!({"status": {"counts": counts}})))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["status.counts.scanned"], "{e:?}");
    assert!(
        api.get_status("sts").await.unwrap().status.is_none(),
        "a refused status write was stored"
    );
    // Unknown status fields are pruned; known ones kept.
    let st = api
        .patch_status(
            "sts",
            &pp(),
            &merge(json!({"status": {"phase": "Pending", "bogus": 1}})),
        )
        .await
        .unwrap();
    assert_eq!(st.status.unwrap().phase, Some(Phase::Pending));
    let raw = raw_replays(env).get("sts").await.unwrap();
    assert!(raw.data["status"].get("bogus").is_none(), "{}", raw.data);
    // The operator's own status write: a server-side apply of conditions as Kubernetes' own
    // (`metav1.Condition`, with `observedGeneration`).
    let condition = k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        type_: "Ready".into(),
        status: "False".into(),
        reason: "Pending".into(),
        message: "waiting".into(),
        last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap(),
        ),
        observed_generation: Some(1),
    };
    let applied = api
        .patch_status(
            "sts",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "status": {"phase": "Pending", "conditions": [condition]},
            })),
        )
        .await
        .unwrap();
    assert_eq!(applied.status.unwrap().conditions[0].reason, "Pending");
}

/// Unknown fields are pruned with a `Warning` header, as kube-apiserver's default
/// `fieldValidation=Warn` does.
async fn pruned_fields_are_warned_about(env: &Env) {
    let body = serde_json::to_vec(&raw_replay("w", json!({"bogus": 1}))).unwrap();
    let request = hyper::Request::post(format!(
        "/apis/replay.dlq.dev/v1alpha1/namespaces/{}/dlqreplays",
        env.ns
    ))
    .header("content-type", "application/json")
    .body(kube::client::Body::from(body))
    .unwrap();
    let response = env.client.send(request).await.unwrap();
    assert_eq!(response.status().as_u16(), 201);
    let warnings: Vec<&str> = response
        .headers()
        .get_all("warning")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(warnings, [r#"299 - "unknown field \"spec.bogus\"""#]);
}

/// A watch with `timeoutSeconds` ends its stream then. (From a listed resourceVersion: from "0"
/// with bookmarks, kube-apiserver v1.36 on etcd 3.5.1 answers an ERROR 500 event, "the required
/// storage feature RequestWatchProgress is disabled".)
async fn watch_timeout_ends_the_stream(env: &Env) {
    let api = env.replays();
    let from = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let started = std::time::Instant::now();
    let mut s = api
        .watch(&WatchParams::default().timeout(1), &from)
        .await
        .unwrap()
        .boxed();
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.try_next().await {
                Ok(Some(WatchEvent::Bookmark(_))) => {}
                other => return other,
            }
        }
    })
    .await;
    assert!(matches!(end, Ok(Ok(None))), "{end:?}");
    assert!(started.elapsed() >= Duration::from_millis(900));
}

/// Deleting a replay without finalizers answers a `Status` and a watch sees it DELETED; strategic
/// merge patches are refused for custom resources (415).
async fn delete_of_custom_resource_answers_status_and_watch_sees_deleted(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("d", &env.ns))
        .await
        .unwrap();
    let mut s = api
        .watch(
            &WatchParams::default().timeout(30),
            &a.resource_version().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    let res = api.delete("d", &DeleteParams::default()).await.unwrap();
    assert!(
        res.is_right(),
        "a Status for an immediate delete of a custom resource"
    );
    // Generous: under a loaded CI machine the event can take seconds; a missing one still fails.
    let deleted = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match s.try_next().await {
                Ok(Some(WatchEvent::Bookmark(_))) => {}
                other => return other,
            }
        }
    })
    .await;
    match deleted {
        Ok(Ok(Some(WatchEvent::Deleted(o)))) => assert!(rv(&o) > rv(&a)),
        other => panic!("expected DELETED, got {other:?}"),
    }
    assert!(api.get_opt("d").await.unwrap().is_none());
    api.create(&PostParams::default(), &replay("d", &env.ns))
        .await
        .unwrap();
    let e = api
        .patch(
            "d",
            &pp(),
            &Patch::Strategic(json!({"spec": {"suspend": true}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 415, "{e:?}");
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

// ---------------------------------------------------------------- the fake's own helpers

mod fake_only {
    use super::*;

    /// A replay an older CRD admitted (`messagesPerSecond: 0`, quarantine = source) after the
    /// committed CRD is applied over it: what leaves the bad values alone passes (ratcheting:
    /// metadata, the status, the finalizer the operator adds), a change of the spec is checked
    /// again, and the cross-field rule of the changed spec node refuses it.
    #[tokio::test]
    async fn an_upgraded_crd_ratchets_what_an_older_one_admitted() {
        use dlq_replay_testkit::fake_api::{committed_crd, crd_before_the_rules};
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        let fake = FakeApi::start().await;
        let crds: Api<CustomResourceDefinition> = Api::all(fake.client());
        let name = committed_crd().metadata.name.unwrap();
        let apply = |crd: CustomResourceDefinition| {
            let crds = crds.clone();
            let name = name.clone();
            async move {
                crds.patch(
                    &name,
                    &PatchParams::apply(MANAGER).force(),
                    &Patch::Apply(crd),
                )
                .await
                .expect("apply the CRD")
            }
        };
        apply(crd_before_the_rules()).await;
        let env = Env {
            client: fake.client(),
            ns: "ops".into(),
            fake: None,
        };
        let bad = json!({"rate": {"messagesPerSecond": 0}, "quarantine": {"queue": "old-dlq"}});
        raw_replays(&env)
            .create(&PostParams::default(), &raw_replay("old", bad.clone()))
            .await
            .expect("admitted by the older CRD");
        apply(committed_crd()).await;
        // Now refused on create...
        let e = raw_replays(&env)
            .create(&PostParams::default(), &raw_replay("new", bad))
            .await
            .unwrap_err();
        assert_eq!(api_code(&e).0, 422);
        // ...but the stored one may still be labelled, finalized and given a status.
        let api = env.replays();
        api.patch(
            "old",
            &pp(),
            &merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .expect("a metadata change");
        api.patch(
            "old",
            &pp(),
            &merge(json!({"metadata": {"finalizers": [FINALIZER]}})),
        )
        .await
        .expect("a finalizer");
        api.patch_status("old", &pp(), &merge(json!({"status": {"phase": "Failed"}})))
            .await
            .expect("a status write");
        // A change of the spec evaluates the spec's rules again: the unchanged rate is
        // ratcheted, the cross-field rule of the changed node is not.
        let e = api
            .patch("old", &pp(), &merge(json!({"spec": {"suspend": true}})))
            .await
            .unwrap_err();
        assert_eq!(causes(&e), ["spec.quarantine.queue"], "{e:?}");
    }

    #[tokio::test]
    async fn put_secret_is_visible_to_get_and_watch() {
        let fake = FakeApi::start().await;
        let secrets: Api<Secret> = Api::namespaced(fake.client(), "ops");
        let list = secrets.list(&ListParams::default()).await.unwrap();
        let from = list.metadata.resource_version.unwrap();
        let mut stream = secrets
            .watch(&WatchParams::default().timeout(10), &from)
            .await
            .unwrap()
            .boxed();
        fake.put_secret("ops", "amqp", &[("url", "amqp://x"), ("user", "guest")]);
        let s = secrets.get("amqp").await.unwrap();
        let data = s.data.unwrap();
        assert_eq!(data["url"].0, b"amqp://x");
        assert_eq!(data["user"].0, b"guest");
        let raw = fake.get_json("secrets", "ops", "amqp").unwrap();
        assert_eq!(raw["data"]["url"], "YW1xcDovL3g=");
        match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
            Ok(Ok(Some(WatchEvent::Added(s)))) => assert_eq!(s.name_any(), "amqp"),
            other => panic!("expected ADDED amqp, got {other:?}"),
        }
        // A second put replaces the data and is a MODIFIED.
        fake.put_secret("ops", "amqp", &[("url", "amqp://y")]);
        match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
            Ok(Ok(Some(WatchEvent::Modified(s)))) => {
                let data = s.data.unwrap();
                assert_eq!(data["url"].0, b"amqp://y");
                assert!(!data.contains_key("user"));
            }
            other => panic!("expected MODIFIED amqp, got {other:?}"),
        }
        // Default namespace of the client is "default".
        fake.put_secret("default", "d", &[("k", "v")]);
        let d: Api<Secret> = Api::default_namespaced(fake.client());
        assert!(d.get_opt("d").await.unwrap().is_some());
    }

    #[tokio::test]
    async fn status_writes_are_counted() {
        let fake = FakeApi::start().await;
        let api: Api<DlqReplay> = Api::namespaced(fake.client(), "ops");
        api.create(&PostParams::default(), &replay("sw", "ops"))
            .await
            .unwrap();
        assert_eq!(fake.status_writes("ops", "sw"), 0);
        let st = json!({"status": {"phase": "Pending"}});
        api.patch_status("sw", &pp(), &merge(st.clone()))
            .await
            .unwrap();
        api.patch_status("sw", &pp(), &merge(st)).await.unwrap();
        api.patch("sw", &pp(), &merge(json!({"spec": {"suspend": true}})))
            .await
            .unwrap();
        assert_eq!(
            fake.status_writes("ops", "sw"),
            2,
            "spec writes are not status writes"
        );
        let raw = fake.get_json("dlqreplays", "ops", "sw").unwrap();
        assert_eq!(raw["status"]["phase"], "Pending");
        assert_eq!(raw["metadata"]["generation"], 2);
        assert!(fake.get_json("dlqreplays", "ops", "nope").is_none());
    }

    /// Streaming lists (`sendInitialEvents`): not on the real server of the tests, whose etcd
    /// (3.5.1) lacks what kube-apiserver needs for them (it answers 500, "the required storage
    /// feature RequestWatchProgress is disabled"); the operator lists, then watches.
    #[tokio::test]
    async fn streaming_list_watcher_works() {
        let fake = FakeApi::start().await;
        let api: Api<DlqReplay> = Api::namespaced(fake.client(), "ops");
        api.create(&PostParams::default(), &replay("s1", "ops"))
            .await
            .unwrap();
        let mut w = watcher(api.clone(), watcher::Config::default().streaming_lists()).boxed();
        let mut initial = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(ev) = w.next().await {
                match ev.unwrap() {
                    watcher::Event::InitApply(o) => initial.push(o.name_any()),
                    watcher::Event::InitDone => break,
                    _ => {}
                }
            }
        })
        .await
        .expect("initial events");
        assert_eq!(initial, ["s1"]);
        api.create(&PostParams::default(), &replay("s2", "ops"))
            .await
            .unwrap();
        let next = tokio::time::timeout(Duration::from_secs(5), w.next()).await;
        assert!(
            matches!(&next, Ok(Some(Ok(watcher::Event::Apply(o)))) if o.name_any() == "s2"),
            "{next:?}"
        );
    }

    #[tokio::test]
    async fn expired_watch_answers_410_error_event() {
        let fake = FakeApi::start().await;
        let api: Api<DlqReplay> = Api::namespaced(fake.client(), "ops");
        let a = api
            .create(&PostParams::default(), &replay("x", "ops"))
            .await
            .unwrap();
        fake.expire_watches();
        let mut s = api
            .watch(&WatchParams::default(), &a.resource_version().unwrap())
            .await
            .unwrap()
            .boxed();
        match s.try_next().await {
            Ok(Some(WatchEvent::Error(st))) => {
                assert_eq!(st.code, 410);
                assert_eq!(st.reason, "Expired");
            }
            other => panic!("expected an ERROR 410 event, got {other:?}"),
        }
        assert!(
            s.try_next().await.unwrap().is_none(),
            "the stream ends after the 410"
        );
        // From the current version it is fine.
        let now = api.list(&ListParams::default()).await.unwrap();
        let mut s = api
            .watch(
                &WatchParams::default().timeout(5),
                &now.metadata.resource_version.unwrap(),
            )
            .await
            .unwrap()
            .boxed();
        api.patch(
            "x",
            &pp(),
            &merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
        assert!(matches!(
            s.try_next().await,
            Ok(Some(WatchEvent::Modified(_)))
        ));
    }
}
