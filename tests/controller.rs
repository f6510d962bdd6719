//! The real kube-runtime Controller, with the real RabbitMQ and Redis, through whole lifecycles.
//!
//! Every scenario is written once against [`Cluster`] and runs twice: `fake::NAME` against the
//! in-process fake API server (`crates/testkit/src/fake_api.rs`), and `e2e::NAME` against a real
//! cluster when `E2E=1` and `KUBECONFIG` are set (a fresh namespace per test, the CRD from
//! `crds/dlqreplay.yaml` applied first, the namespace deleted after). Without them the `e2e::*`
//! tests print `SKIPPED: E2E=1 and KUBECONFIG not set` and do nothing else. The operator always
//! runs in this process (or, for the binary test, as a child of it), against the local RabbitMQ
//! and Redis, whose URLs the Secrets hold. The fake gets a fresh namespace per test as well, and
//! on both the engine's Redis state of the test's namespace is deleted after the test.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use dlq_replay::api::{DlqReplay, Phase};
use dlq_replay::controller::{self, Settings};
use dlq_replay_testkit::cluster::Cluster;
use dlq_replay_testkit::world::*;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::{json, Value};

fn resource(w: &World, ns: &str, name: &str, extra: &str) -> DlqReplay {
    let text = format!(
        "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  broker: {{urlSecretRef: {{name: rabbitmq, key: url}}}}\n  source: {{queue: {dlq}}}\n  quarantine: {{queue: {q}}}\n  audit: {{redis: {{urlSecretRef: {{name: redis, key: url}}}}}}\n  canary: {{enabled: false}}\n{extra}",
        dlq = w.topo.dlq,
        q = w.topo.quarantine,
    );
    dlq_replay::manifest::parse(&text).unwrap_or_else(|e| panic!("{e}"))
}

async fn secrets(c: &Cluster) {
    c.put_secret(c.ns(), "rabbitmq", &[("url", AMQP)]).await;
    c.put_secret(c.ns(), "redis", &[("url", REDIS)]).await;
}

fn replays(c: &Cluster) -> Api<DlqReplay> {
    Api::namespaced(c.client(), c.ns())
}

fn operator(
    c: &Cluster,
) -> (
    tokio::task::JoinHandle<Result<(), String>>,
    tokio::sync::oneshot::Sender<()>,
) {
    operator_with(c, dlq_replay::engine::Options::default())
}

/// [`operator`] with these engine knobs.
fn operator_with(
    c: &Cluster,
    engine: dlq_replay::engine::Options,
) -> (
    tokio::task::JoinHandle<Result<(), String>>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let settings = Settings {
        namespace: c.watch_namespace(),
        status_interval: Duration::from_millis(500),
        engine,
        ..Settings::default()
    };
    let handle = tokio::spawn(controller::run_until(c.client(), settings, async move {
        let _ = stop_rx.await;
    }));
    (handle, stop_tx)
}

async fn wait_for(
    api: &Api<DlqReplay>,
    name: &str,
    what: &str,
    f: impl Fn(&DlqReplay) -> bool,
) -> DlqReplay {
    let t = Instant::now();
    loop {
        if let Some(r) = api.get_opt(name).await.unwrap() {
            if f(&r) {
                return r;
            }
            if t.elapsed() > Duration::from_secs(40) {
                panic!("{name}: gave up waiting for {what}; status {:?}", r.status);
            }
        } else if t.elapsed() > Duration::from_secs(40) {
            panic!("{name}: gone while waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The events of the test's namespace once `f` holds of them, or as they are after 10 s: an event
/// is published just after the status write that a test waits for.
async fn events_once(c: &Cluster, f: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let t = Instant::now();
    loop {
        let events = c.events(c.ns()).await;
        if f(&events) || t.elapsed() > Duration::from_secs(10) {
            return events;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn reasons(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| e["reason"].as_str().map(String::from))
        .collect()
}

fn phase(r: &DlqReplay) -> Option<Phase> {
    r.status.as_ref().and_then(|s| s.phase)
}

/// What `kubectl get dlqreplays` prints, from the CRD's printer columns.
/// The status (True/False) of the condition `type_`, as kstatus and `kubectl wait` read it.
fn condition(r: &DlqReplay, type_: &str) -> Option<String> {
    r.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .map(|c| c.status.clone())
}

fn kubectl_get(replays: &[DlqReplay]) -> String {
    let mut out = format!(
        "{:<16} {:<10} {:>9} {:>11} {:>12} {:>7}\n",
        "NAME", "PHASE", "REPLAYED", "DUPLICATES", "QUARANTINED", "FAILED"
    );
    for r in replays {
        let s = r.status.clone().unwrap_or_default();
        out += &format!(
            "{:<16} {:<10} {:>9} {:>11} {:>12} {:>7}\n",
            r.metadata.name.clone().unwrap_or_default(),
            s.phase.map(|p| p.to_string()).unwrap_or_default(),
            s.counts.replayed,
            s.counts.duplicates,
            s.counts.quarantined,
            s.counts.failed
        );
    }
    out
}

async fn apply_runs_the_replay_to_done_with_correct_counts_and_events(c: &Cluster) {
    let w = World::new("ctl-done").await;
    let mut jobs: Vec<_> = (0..30).map(|i| job(&format!("j{i}"), json!({}))).collect();
    let mut bad = job("bad", json!({}));
    bad.1 = b"nope".to_vec();
    jobs.push(bad);
    w.dead_letter(jobs).await;
    w.set(&w.key("j0"), "done").await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let extra = format!(
        "  poison: {{requiredFields: [/id]}}\n{}  rate: {{messagesPerSecond: 20}}\n",
        w.idempotency("Check")
    );
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "done", &extra),
    )
    .await
    .unwrap();
    let r = wait_for(&api, "done", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = r.status.clone().unwrap();
    assert_eq!(
        (s.counts.replayed, s.counts.duplicates, s.counts.quarantined),
        (29, 1, 1),
        "{s:?}"
    );
    assert_eq!(s.observed_generation, Some(1));
    assert!(s
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True"));
    // kstatus: Current (`kubectl wait --for=condition=Ready` returns).
    assert_eq!(condition(&r, "Reconciling").as_deref(), Some("False"));
    assert_eq!(condition(&r, "Stalled").as_deref(), Some("False"));
    assert!(r.finalizers().iter().any(|f| f == controller::FINALIZER));
    // Conditions as metav1.Condition, each with the generation it was computed for; the status
    // is server-side applied by the operator's field manager (a real server records it).
    let raw = c.get_json("dlqreplays", c.ns(), "done").await.unwrap();
    let conditions = raw["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        !conditions.is_empty() && conditions.iter().all(|c| c["observedGeneration"] == 1),
        "{raw}"
    );
    if c.is_real() {
        let applied = raw["metadata"]["managedFields"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .any(|m| {
                m["manager"] == controller::MANAGER
                    && m["operation"] == "Apply"
                    && m["subresource"] == "status"
            });
        assert!(applied, "status not server-side applied: {raw}");
    }
    // 29 replays at 20/s is about 1.5 s: throttled to a write per 0.5 s, not one per message.
    // (A real cluster does not count status writes: checked on the fake only.)
    if let Some(writes) = c.status_writes(c.ns(), "done") {
        assert!(writes < 15, "{writes} status writes");
    }
    let events = events_once(c, |e| {
        let r = reasons(e);
        r.iter().any(|r| r == "Draining") && r.iter().any(|r| r == "Done")
    })
    .await;
    let reasons = reasons(&events);
    assert!(
        reasons.contains(&"Draining".to_string()) && reasons.contains(&"Done".to_string()),
        "{reasons:?}"
    );
    eprintln!(
        "$ kubectl get dlqreplays -n {}\n{}",
        c.ns(),
        kubectl_get(&[r])
    );
    assert_eq!(w.take(&w.topo.work).await.len(), 29);
    // Re-applying the same manifest starts nothing new: a Done replay stays done.
    let patch = json!({"metadata": {"labels": {"touched": "yes"}}});
    api.patch("done", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(phase(&api.get("done").await.unwrap()), Some(Phase::Done));
    assert_eq!(w.depth(&w.topo.work).await, 0);
    w.cleanup().await;
}

async fn a_missing_secret_keeps_it_pending_until_the_secret_exists(c: &Cluster) {
    let w = World::new("ctl-secret").await;
    w.dead_letter((0..5).map(|i| job(&format!("s{i}"), json!({}))).collect())
        .await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(&PostParams::default(), &resource(&w, c.ns(), "sec", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "sec", "Pending", |r| phase(r) == Some(Phase::Pending)).await;
    let msg = r.status.unwrap().replay.message.unwrap();
    assert!(
        msg.contains("SecretMissing") && msg.contains("rabbitmq"),
        "{msg}"
    );
    assert_eq!(w.depth(&w.topo.dlq).await, 5);
    secrets(c).await;
    let r = wait_for(&api, "sec", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 5);
    // No password in status or events.
    let dump = format!(
        "{:?}{:?}",
        api.get("sec").await.unwrap().status,
        c.events(c.ns()).await
    );
    assert!(!dump.contains("guest:guest"), "a URL password leaked");
    w.cleanup().await;
}

async fn an_evicting_redis_keeps_it_pending_until_its_policy_changes(c: &Cluster) {
    let w = World::new("ctl-evict").await;
    w.dead_letter((0..5).map(|i| job(&format!("v{i}"), json!({}))).collect())
        .await;
    let redis = dlq_replay_testkit::faults::OwnRedis::start_with(&[
        "--maxmemory",
        "64mb",
        "--maxmemory-policy",
        "allkeys-lru",
    ]);
    c.put_secret(c.ns(), "rabbitmq", &[("url", AMQP)]).await;
    c.put_secret(c.ns(), "redis", &[("url", &redis.url())])
        .await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(&PostParams::default(), &resource(&w, c.ns(), "evict", ""))
        .await
        .unwrap();
    let said = |r: &DlqReplay| {
        r.status
            .as_ref()
            .and_then(|s| s.message.clone())
            .unwrap_or_default()
    };
    let r = wait_for(&api, "evict", "Pending on the eviction policy", |r| {
        phase(r) == Some(Phase::Pending) && said(r).contains("allkeys-lru")
    })
    .await;
    assert!(
        said(&r).contains("spec.audit.acceptRedisEviction"),
        "{}",
        said(&r)
    );
    assert_eq!(w.depth(&w.topo.dlq).await, 5, "nothing moved");
    // The Redis's owner changes the policy: the replay goes on by itself.
    let mut admin = dlq_replay::engine::store::connect(&redis.url())
        .await
        .unwrap();
    redis::cmd("CONFIG")
        .arg(["SET", "maxmemory-policy", "noeviction"].as_slice())
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let r = wait_for(&api, "evict", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = r.status.unwrap();
    assert_eq!((s.counts.replayed, s.replay.redis_eviction_risk), (5, None));
    w.cleanup().await;
}

async fn a_second_replay_of_the_same_queue_waits_source_busy(c: &Cluster) {
    let w = World::new("ctl-busy").await;
    w.dead_letter((0..40).map(|i| job(&format!("b{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "first", "  rate: {messagesPerSecond: 20}\n"),
    )
    .await
    .unwrap();
    wait_for(&api, "first", "Draining", |r| {
        phase(r) == Some(Phase::Draining)
    })
    .await;
    api.create(&PostParams::default(), &resource(&w, c.ns(), "second", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "second", "SourceBusy", |r| {
        r.status
            .as_ref()
            .and_then(|s| s.message.clone())
            .is_some_and(|m| m.contains("SourceBusy"))
    })
    .await;
    assert_eq!(phase(&r), Some(Phase::Pending));
    wait_for(&api, "first", "Done", |r| phase(r) == Some(Phase::Done)).await;
    // Once the first is done the second runs, and finds nothing left.
    let r = wait_for(&api, "second", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.scanned, 0);
    assert_eq!(w.take(&w.topo.work).await.len(), 40);
    w.cleanup().await;
}

/// Set `spec.suspend` of replay `name`.
async fn suspend(api: &Api<DlqReplay>, name: &str, on: bool) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": on}})),
    )
    .await
    .unwrap();
}

async fn suspend_pauses_after_in_flight_settles_and_resume_finishes(c: &Cluster) {
    let w = World::new("ctl-suspend").await;
    w.dead_letter((0..60).map(|i| job(&format!("p{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "sus", "  rate: {messagesPerSecond: 20}\n"),
    )
    .await
    .unwrap();
    wait_for(&api, "sus", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    suspend(&api, "sus", true).await;
    // Suspended, and the status is of the new generation (kstatus and Argo CD wait for that),
    // with none of Ready, Reconciling and Stalled True.
    let r = wait_for(&api, "sus", "Suspended of generation 2", |r| {
        phase(r) == Some(Phase::Suspended)
            && r.status.as_ref().and_then(|s| s.observed_generation) == r.metadata.generation
    })
    .await;
    for type_ in ["Ready", "Reconciling", "Stalled"] {
        assert_eq!(condition(&r, type_).as_deref(), Some("False"), "{type_}");
    }
    let at_pause = r.status.unwrap().counts.replayed;
    assert!(at_pause < 60, "suspended too late");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        w.depth(&w.topo.work).await as u64,
        at_pause,
        "published while suspended"
    );
    assert_eq!(
        w.depth(&w.topo.dlq).await as u64,
        60 - at_pause,
        "a message was half done"
    );
    suspend(&api, "sus", false).await;
    let r = wait_for(&api, "sus", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 60);
    // Suspending the ended replay changes nothing but is observed: its status is of the new
    // generation (else kstatus reads it as in progress for ever), still Done and Ready.
    suspend(&api, "sus", true).await;
    let r = wait_for(&api, "sus", "Done of generation 4", |r| {
        r.metadata.generation == Some(4)
            && r.status.as_ref().and_then(|s| s.observed_generation) == Some(4)
    })
    .await;
    assert_eq!(phase(&r), Some(Phase::Done));
    assert_eq!(condition(&r, "Ready").as_deref(), Some("True"));
    assert_eq!(r.status.unwrap().counts.replayed, 60);
    assert_eq!(w.take(&w.topo.work).await.len(), 60);
    w.cleanup().await;
}

async fn deleting_mid_drain_stops_cleanly_and_loses_nothing(c: &Cluster) {
    let w = World::new("ctl-delete").await;
    w.dead_letter((0..60).map(|i| job(&format!("d{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "del", "  rate: {messagesPerSecond: 20}\n"),
    )
    .await
    .unwrap();
    wait_for(&api, "del", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    api.delete("del", &DeleteParams::default()).await.unwrap();
    let t = Instant::now();
    while api.get_opt("del").await.unwrap().is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the finalizer never let go"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let target = w.depth(&w.topo.work).await;
    let left = w.depth(&w.topo.dlq).await;
    assert!(target < 60, "the replay was not stopped");
    assert_eq!(target + left, 60, "target {target} + dlq {left}");
    // Created again under the same name, it is a new replay (new uid): it drains the rest.
    api.create(&PostParams::default(), &resource(&w, c.ns(), "del", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "del", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, u64::from(left));
    assert_eq!(w.depth(&w.topo.work).await, 60);
    // A finished replay deleted and created again is not "already done": it replays anew.
    api.delete("del", &DeleteParams::default()).await.unwrap();
    while api.get_opt("del").await.unwrap().is_some() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(w.take(&w.topo.work).await.len(), 60);
    w.dead_letter(vec![job("late-1", json!({})), job("late-2", json!({}))])
        .await;
    api.create(&PostParams::default(), &resource(&w, c.ns(), "del", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "del", "Done again", |r| {
        phase(r) == Some(Phase::Done) && r.status.as_ref().is_some_and(|s| s.counts.replayed == 2)
    })
    .await;
    assert_eq!(r.status.unwrap().counts.scanned, 2);
    let ids: Vec<String> = w
        .take(&w.topo.work)
        .await
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(ids, ["late-1", "late-2"]);
    w.cleanup().await;
}

async fn an_operator_restart_mid_drain_resumes_and_loses_nothing(c: &Cluster) {
    let w = World::new("ctl-restart").await;
    w.dead_letter((0..60).map(|i| job(&format!("r{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (op, stop) = operator(c);
    let api = replays(c);
    let extra = format!(
        "{}  rate: {{messagesPerSecond: 20}}\n",
        w.idempotency("Claim")
    );
    api.create(&PostParams::default(), &resource(&w, c.ns(), "rst", &extra))
        .await
        .unwrap();
    let before = wait_for(&api, "rst", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    let id = before.status.unwrap().replay.replay_id;
    stop.send(()).unwrap();
    op.await.unwrap().unwrap();
    // The operator's own stop is not the user's suspend: the replay waits for the next leader.
    let stopped = api.get("rst").await.unwrap().status.unwrap();
    assert_eq!(stopped.phase, Some(Phase::Pending), "{stopped:?}");
    let why = stopped.replay.message.unwrap_or_default();
    assert!(why.starts_with("OperatorStopped:"), "{why}");
    let (_op2, _stop2) = operator(c);
    let r = wait_for(&api, "rst", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = r.status.unwrap();
    assert_eq!(s.replay_id, id, "a restart must resume the same replay");
    let target = w.take(&w.topo.work).await;
    assert_each_key_once(&target);
    assert_eq!(
        target.len() as u64 + w.depth(&w.topo.quarantine).await as u64,
        60,
        "{s:?}"
    );
    w.cleanup().await;
}

async fn a_canary_that_dies_again_ends_canary_failed(c: &Cluster) {
    let w = World::new("ctl-canary").await;
    w.dead_letter((0..6).map(|i| job(&format!("c{i}"), json!({}))).collect())
        .await;
    // A worker that still fails every job.
    let _worker = w.worker(|_| true).await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let mut r = resource(&w, c.ns(), "can", "");
    r.spec.canary.enabled = true;
    r.spec.canary.wait_seconds = 5;
    api.create(&PostParams::default(), &r).await.unwrap();
    let r = wait_for(&api, "can", "CanaryFailed", |r| {
        phase(r) == Some(Phase::CanaryFailed)
    })
    .await;
    // kstatus: Failed.
    assert_eq!(condition(&r, "Stalled").as_deref(), Some("True"));
    assert_eq!(condition(&r, "Ready").as_deref(), Some("False"));
    assert_eq!(condition(&r, "Reconciling").as_deref(), Some("False"));
    let s = r.status.unwrap();
    assert_eq!(s.canary[0].result, dlq_replay::api::CanaryResult::DiedAgain);
    assert_eq!(w.depth(&w.topo.dlq).await, 6);
    let failed = |e: &Value| e["reason"] == "CanaryFailed" && e["type"] == "Warning";
    let died = |e: &Value| {
        e["reason"] == "CanaryDiedAgain"
            && e["note"].as_str().is_some_and(|n| n.contains("rejected"))
    };
    let events = events_once(c, |es| es.iter().any(failed) && es.iter().any(died)).await;
    assert!(events.iter().any(failed));
    assert!(events.iter().any(died), "no event for the canary's result");
    w.cleanup().await;
}

/// `rabbitmqctl close_connection` on every broker connection of the replay `ns/name` (named
/// `dlq-replay NS/NAME ROLE`); returns how many there were.
fn close_replay_connections(w: &World, ns: &str, name: &str) -> usize {
    let out = w
        .target
        .broker
        .must_ctl(&["list_connections", "pid", "client_properties", "-q"]);
    let tag = format!("dlq-replay {ns}/{name} ");
    let pids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&tag))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    for pid in &pids {
        let _ = w
            .target
            .broker
            .ctl(&["close_connection", pid, "test: broker outage"])
            .output();
    }
    pids.len()
}

/// The seconds to live of a replay's Redis keys (state, settled marks, audit stream and its
/// dictionary); -2 for a key that is gone.
async fn ttls(w: &World, r: &DlqReplay) -> Vec<(String, i64)> {
    let s = r.status.clone().unwrap();
    let id = s.replay.replay_id.unwrap();
    let state_name = format!(
        "{}/{}@{}",
        r.namespace().unwrap(),
        r.name_any(),
        r.uid().unwrap()
    );
    let audit = s.replay.audit.unwrap().key;
    let keys = [
        format!("dlq:replay:{state_name}"),
        format!("dlq:settled:{state_name}/{id}"),
        format!("{audit}#dict"),
        audit,
    ];
    let mut con = w.redis.clone();
    let mut out = Vec::new();
    for k in keys {
        let ttl: i64 = redis::cmd("TTL")
            .arg(&k)
            .query_async(&mut con)
            .await
            .unwrap();
        out.push((k, ttl));
    }
    out
}

async fn annotate_retry(api: &Api<DlqReplay>, name: &str, value: &str) {
    let patch = json!({"metadata": {"annotations": {dlq_replay::api::RETRY_ANNOTATION: value}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// A replay that ends `Failed` (the broker went away for longer than the reconnect budget,
/// here 0 s) is retried in place by the `replay.dlq.dev/retry` annotation: same replay id, it
/// resumes where it stopped and ends Done, each key published once. A Done replay is not
/// retried (a Warning Event says why). Its Redis keys expire within its retention.
async fn a_failed_replay_is_retried_in_place_under_the_same_replay_id(c: &Cluster) {
    let w = World::new("ctl-retry").await;
    w.dead_letter((0..60).map(|i| job(&format!("f{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator_with(
        c,
        dlq_replay::engine::Options {
            reconnect: Duration::ZERO,
            ..Default::default()
        },
    );
    let api = replays(c);
    let extra = format!(
        "{}  rate: {{messagesPerSecond: 20}}\n",
        w.idempotency("Claim")
    );
    let mut r = resource(&w, c.ns(), "retry", &extra);
    r.spec.audit.as_mut().unwrap().retention_seconds = 7200;
    // A value the manifest carries from the start is not a retry.
    r.metadata.annotations = Some(
        [(
            dlq_replay::api::RETRY_ANNOTATION.to_string(),
            "0".to_string(),
        )]
        .into(),
    );
    api.create(&PostParams::default(), &r).await.unwrap();
    let before = wait_for(&api, "retry", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    let id = before.status.unwrap().replay.replay_id;
    assert!(id.is_some());
    let t = Instant::now();
    while close_replay_connections(&w, c.ns(), "retry") == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no connection to close"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let failed = wait_for(&api, "retry", "Failed", |r| phase(r) == Some(Phase::Failed)).await;
    let s = failed.status.clone().unwrap();
    assert!(
        s.message
            .as_deref()
            .unwrap_or("")
            .contains("gave up reconnecting"),
        "{s:?}"
    );
    assert!(s.counts.replayed < 60, "{s:?}");
    assert_eq!(s.retried_for.as_deref(), Some("0"), "{s:?}");
    // Nothing happens until the annotation changes.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(phase(&api.get("retry").await.unwrap()), Some(Phase::Failed));

    annotate_retry(&api, "retry", "1").await;
    let done = wait_for(&api, "retry", "Done after the retry", |r| {
        phase(r) == Some(Phase::Done)
    })
    .await;
    let s = done.status.clone().unwrap();
    assert_eq!(s.replay_id, id, "a retry in place keeps the replay id");
    assert_eq!(s.retried_for.as_deref(), Some("1"));
    assert_sum(&s);
    let target = w.take(&w.topo.work).await;
    assert_each_key_once(&target);
    // Publishes the outage left unconfirmed are quarantined OutcomeUnknown, never sent twice.
    let quarantined = w.depth(&w.topo.quarantine).await as usize;
    assert_eq!(target.len() + quarantined, 60, "{s:?}");
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    let events = events_once(c, |e| {
        e.iter().any(|e| {
            e["reason"] == "Pending"
                && e["note"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("Retrying:"))
        })
    })
    .await;
    assert!(
        events.iter().any(|e| e["note"]
            .as_str()
            .is_some_and(|n| n.starts_with("Retrying:"))),
        "{:?}",
        reasons(&events)
    );

    // spec.audit.retentionSeconds: the keys expire within 2 h of the end; the settled marks
    // serve a resume only, so a Done replay has none left.
    for (key, ttl) in ttls(&w, &done).await {
        if key.starts_with("dlq:settled:") {
            assert_eq!(ttl, -2, "{key} outlived Done");
        } else {
            assert!((7000..=7200).contains(&ttl), "{key}: TTL {ttl}");
        }
    }

    // A Done replay is not retried: the annotation is recorded as acted on, with a Warning.
    annotate_retry(&api, "retry", "2").await;
    let refused = wait_for(&api, "retry", "retriedFor 2", |r| {
        r.status.as_ref().and_then(|s| s.retried_for.as_deref()) == Some("2")
    })
    .await;
    assert_eq!(phase(&refused), Some(Phase::Done));
    assert_eq!(refused.status.unwrap().counts, s.counts);
    let warning = |e: &Value| e["reason"] == "RetryRefused" && e["type"] == "Warning";
    let events = events_once(c, |es| es.iter().any(warning)).await;
    assert!(events.iter().any(warning), "{:?}", reasons(&events));
    w.cleanup().await;
}

/// A replay whose every canary came back (`CanaryFailed`) is retried in place once the fix is
/// deployed: its stored end and canary decisions are removed, a new canary goes first, passes,
/// and the rest drains, under the same replay id. The canary that came back the first time
/// stays in the DLQ: it carries this replay's id, and a replay never replays its own returns.
async fn a_canary_failed_replay_is_retried_in_place_with_new_canaries(c: &Cluster) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let w = World::new("ctl-recanary").await;
    w.dead_letter((0..6).map(|i| job(&format!("c{i}"), json!({}))).collect())
        .await;
    let broken = Arc::new(AtomicBool::new(true));
    let still_broken = broken.clone();
    let _worker = w.worker(move |_| still_broken.load(Ordering::SeqCst)).await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let mut r = resource(&w, c.ns(), "recan", "");
    r.spec.canary.enabled = true;
    r.spec.canary.wait_seconds = 5;
    api.create(&PostParams::default(), &r).await.unwrap();
    let first = wait_for(&api, "recan", "CanaryFailed", |r| {
        phase(r) == Some(Phase::CanaryFailed)
    })
    .await;
    let id = first.status.unwrap().replay.replay_id;
    // The fix is deployed; the retry sends a new canary.
    broken.store(false, Ordering::SeqCst);
    annotate_retry(&api, "recan", "after-fix").await;
    let done = wait_for(&api, "recan", "Done after the retry", |r| {
        phase(r) == Some(Phase::Done)
    })
    .await;
    let s = done.status.unwrap();
    assert_eq!(s.replay_id, id, "a retry in place keeps the replay id");
    assert_eq!(s.retried_for.as_deref(), Some("after-fix"));
    assert_eq!(s.canary.len(), 1, "{s:?}");
    assert_eq!(
        s.canary[0].result,
        dlq_replay::api::CanaryResult::Passed,
        "{s:?}"
    );
    // The first canary (replayed, came back) and the 5 others (a new canary and 4 drained).
    assert_eq!(s.counts.replayed, 6, "{s:?}");
    assert_eq!(
        w.depth(&w.topo.dlq).await,
        1,
        "the returned canary stays: {s:?}"
    );
    assert_sum(&s);
    w.cleanup().await;
}

async fn with_two_replicas_only_the_leader_drives_replays(c: &Cluster) {
    let w = World::new("ctl-leader").await;
    w.dead_letter((0..30).map(|i| job(&format!("l{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let replicas: Vec<_> = ["op-a", "op-b"]
        .iter()
        .map(|id| {
            let settings = Settings {
                namespace: c.watch_namespace(),
                instance: id.to_string(),
                status_interval: Duration::from_millis(500),
                ..Settings::default()
            };
            let client = c.client();
            // The Lease in the test's namespace: a real cluster's is shared by concurrent tests.
            let lease_ns = c.ns().to_string();
            tokio::spawn(async move {
                let metrics = dlq_replay::metrics::Metrics::global();
                let shutdown = tokio_util::sync::CancellationToken::new();
                let _ = controller::run_with_leader_election(
                    client, settings, &lease_ns, metrics, shutdown,
                )
                .await;
            })
        })
        .collect();
    let api = replays(c);
    let extra = format!(
        "{}  rate: {{messagesPerSecond: 30}}\n",
        w.idempotency("Claim")
    );
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "lead", &extra),
    )
    .await
    .unwrap();
    let r = wait_for(&api, "lead", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 30);
    let target = w.take(&w.topo.work).await;
    assert_eq!(target.len(), 30, "published by both replicas?");
    let lease = c
        .get_json("leases", c.ns(), "dlq-replay-leader")
        .await
        .expect("a Lease");
    let holder = lease["spec"]["holderIdentity"]
        .as_str()
        .unwrap()
        .to_string();
    // The leader's Done event is the last one published.
    let events = events_once(c, |e| reasons(e).iter().any(|r| r == "Done")).await;
    let instances: std::collections::BTreeSet<String> = events
        .iter()
        .filter_map(|e| e["reportingInstance"].as_str().map(String::from))
        .collect();
    assert_eq!(
        instances,
        [holder].into_iter().collect(),
        "events from a replica that does not lead"
    );
    for r in replicas {
        r.abort();
    }
    w.cleanup().await;
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let _ = s
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

async fn the_operator_binary_drives_a_replay_from_a_kubeconfig_and_serves_metrics(c: &Cluster) {
    let w = World::new("ctl-binary").await;
    w.dead_letter((0..200).map(|i| job(&format!("o{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = c.kubeconfig(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"))
        .args([
            "operator",
            "--namespace",
            c.ns(),
            "--http-addr",
            &format!("127.0.0.1:{port}"),
            "--lease-namespace",
            c.ns(),
        ])
        .env("KUBECONFIG", &kubeconfig)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let t = Instant::now();
    while !http_get(port, "/readyz").await.contains("200 OK") {
        assert!(t.elapsed() < Duration::from_secs(20), "never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = rss_kib(pid);
    let api = replays(c);
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "bin", "  rate: {messagesPerSecond: 100}\n"),
    )
    .await
    .unwrap();
    let mut draining = 0;
    loop {
        let r = api.get("bin").await.unwrap();
        match phase(&r) {
            Some(Phase::Done) => break,
            Some(Phase::Draining) => draining = draining.max(rss_kib(pid)),
            _ => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(40),
            "no Done: {:?}",
            r.status
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("operator RSS: idle {idle} KiB, draining (peak seen) {draining} KiB");
    let metrics = http_get(port, "/metrics").await;
    assert!(
        metrics
            .to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{metrics}"
    );
    assert!(metrics.trim_end().ends_with("# EOF"), "{metrics}");
    assert!(http_get(port, "/healthz").await.contains("200 OK"));
    assert!(
        metrics.contains("dlq_replay_messages_total{decision=\"replayed\"} 200"),
        "{metrics}"
    );
    assert!(metrics.contains("dlq_replay_leader 1"), "{metrics}");
    // The per-replay series the alerts and the dashboard read (deploy/monitoring).
    assert!(
        metrics.contains(r#"name="bin",phase="Done"}"#)
            && metrics.contains(r#"name="bin",of="replayed"} 200"#),
        "{metrics}"
    );
    assert_eq!(w.take(&w.topo.work).await.len(), 200);
    let _ = child.kill().await;
    w.cleanup().await;
}

/// A free local port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The operator binary as one replica: it watches the test's namespace and holds its Lease there,
/// serves /metrics, /healthz and /readyz on `port`; its stderr is collected by `log`.
struct Replica {
    name: String,
    port: u16,
    child: tokio::process::Child,
    log: tokio::task::JoinHandle<String>,
}

async fn replica(c: &Cluster, kubeconfig: &std::ffi::OsStr, name: &str, extra: &[&str]) -> Replica {
    use tokio::io::AsyncReadExt;
    let port = free_port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"))
        .args([
            "operator",
            "--namespace",
            c.ns(),
            "--http-addr",
            &format!("127.0.0.1:{port}"),
            "--lease-namespace",
            c.ns(),
            "--instance",
            name,
            "--status-interval",
            "1",
        ])
        .args(extra)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    // Read as it comes, so that the pipe never fills up.
    let log = tokio::spawn(async move {
        let mut out = Vec::new();
        let _ = stderr.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    });
    let t = Instant::now();
    while !http_get(port, "/readyz").await.contains("200 OK") {
        assert!(t.elapsed() < Duration::from_secs(20), "{name} never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Replica {
        name: name.into(),
        port,
        child,
        log,
    }
}

impl Replica {
    /// SIGTERM, then how long it took to exit and its exit status (`None`: still running after
    /// `within`, then killed).
    async fn terminate(
        &mut self,
        within: Duration,
    ) -> (Duration, Option<std::process::ExitStatus>) {
        let pid = self
            .child
            .id()
            .unwrap_or_else(|| panic!("{} is not running", self.name));
        let t = Instant::now();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(status) => (t.elapsed(), Some(status.unwrap())),
            Err(_) => {
                let _ = self.child.kill().await;
                (t.elapsed(), None)
            }
        }
    }

    async fn log(self) -> String {
        self.log.await.unwrap()
    }
}

async fn lease_holder(c: &Cluster) -> Option<String> {
    c.get_json("leases", c.ns(), controller::LEASE)
        .await
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(String::from))
        .filter(|h| !h.is_empty())
}

async fn sigterm_to_the_leading_operator_mid_drain_exits_0_and_the_other_replica_finishes(
    c: &Cluster,
) {
    sigterm_mid_drain(c, 60, "  rate: {messagesPerSecond: 20}\n", 5).await;
}

/// `n` jobs replayed in Claim mode (`rate` is YAML under spec, or empty) by two operator
/// binaries; SIGTERM to the leader once `progress` are replayed. Prints the durations.
async fn sigterm_mid_drain(c: &Cluster, n: u64, rate: &str, progress: u64) {
    let w = World::new("ctl-sigterm").await;
    w.dead_letter((0..n).map(|i| job(&format!("t{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = c.kubeconfig(dir.path());
    let mut a = replica(c, &kubeconfig, "op-a", &["--log-format", "json"]).await;
    let t = Instant::now();
    while lease_holder(c).await.as_deref() != Some("op-a") {
        assert!(t.elapsed() < Duration::from_secs(20), "op-a never led");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = replica(c, &kubeconfig, "op-b", &[]).await;
    // A follower stops at once, and leaves the Lease alone.
    let mut f = replica(c, &kubeconfig, "op-f", &[]).await;
    let (took, exit) = f.terminate(Duration::from_secs(10)).await;
    eprintln!(
        "shutdown of a following replica: SIGTERM -> exit {} ms",
        took.as_millis()
    );
    assert_eq!(exit.and_then(|e| e.code()), Some(0), "{exit:?}");
    assert_eq!(lease_holder(c).await.as_deref(), Some("op-a"));
    let api = replays(c);
    let extra = format!("{}{rate}", w.idempotency("Claim"));
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "term", &extra),
    )
    .await
    .unwrap();
    let before = wait_for(&api, "term", "some progress", |r| {
        phase(r) == Some(Phase::Draining)
            && r.status
                .as_ref()
                .is_some_and(|s| s.counts.replayed >= progress)
    })
    .await;
    let id = before.status.unwrap().replay.replay_id;
    let (shutdown, exit) = a.terminate(Duration::from_secs(10)).await;
    let exited = Instant::now();
    eprintln!(
        "shutdown of the leading replica: SIGTERM -> exit {} ms ({exit:?})",
        shutdown.as_millis()
    );
    let exit = exit.expect("still running 10 s after SIGTERM");
    assert_eq!(exit.code(), Some(0), "{exit:?}");
    assert_ne!(
        lease_holder(c).await.as_deref(),
        Some("op-a"),
        "the Lease was not released"
    );
    // What op-a left (op-b takes over at its next ask, 2 s at most).
    let stopped_at = api.get("term").await.unwrap().status.unwrap().counts;
    eprintln!(
        "stopped with {} of {n} replayed; {}",
        stopped_at.replayed,
        dlq_replay::engine::summary(&stopped_at)
    );
    let log = a.log().await;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| {
            panic!("--log-format json wrote a line that is not JSON ({e}): {line}")
        });
        assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
    }
    assert!(log.contains("graceful shutdown requested"), "{log}");
    assert!(log.contains("released the lease"), "{log}");
    // The stop is the operator's: the replay waits for the next leader, and says so.
    let stopped = |e: &Value| {
        e["reportingInstance"] == "op-a"
            && e["note"]
                .as_str()
                .is_some_and(|n| n.starts_with("OperatorStopped:"))
    };
    let events = events_once(c, |es| es.iter().any(stopped)).await;
    assert!(events.iter().any(stopped), "{events:?}");
    while lease_holder(c).await.as_deref() != Some("op-b") {
        assert!(exited.elapsed() < Duration::from_secs(10), "op-b never led");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "takeover: op-a exited -> op-b holds the Lease {} ms",
        exited.elapsed().as_millis()
    );
    let r = wait_for(&api, "term", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let metrics = http_get(b.port, "/metrics").await;
    assert!(metrics.contains("dlq_replay_leader 1"), "{metrics}");
    // The per-replay series the alerts and the dashboard read (deploy/monitoring), from the
    // replica that finished it.
    let replayed = r.status.as_ref().map_or(0, |s| s.counts.replayed);
    assert!(
        metrics.contains(r#"name="term",phase="Done"}"#)
            && metrics.contains(&format!(r#"name="term",of="replayed"}} {replayed}"#)),
        "{metrics}"
    );
    assert!(http_get(b.port, "/healthz").await.contains("200 OK"));
    let s = r.status.unwrap();
    assert_eq!(
        s.replay_id, id,
        "the other replica must resume the same replay"
    );
    let target = w.take(&w.topo.work).await;
    assert_each_key_once(&target);
    // A clean stop leaves no outcome unknown: nothing is quarantined, every job replayed once.
    assert_eq!(w.depth(&w.topo.quarantine).await, 0, "{s:?}");
    assert_eq!(target.len() as u64, n, "{s:?}");
    assert_eq!((s.counts.replayed, s.counts.quarantined), (n, 0), "{s:?}");
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    // The follower's logs are text, and without colour codes: its stderr is not a terminal.
    let mut b = b;
    let (_, exit_b) = b.terminate(Duration::from_secs(10)).await;
    assert_eq!(exit_b.and_then(|e| e.code()), Some(0));
    let log_b = b.log().await;
    assert!(
        !log_b.contains('\u{1b}'),
        "ANSI codes in a log written to a pipe"
    );
    assert!(log_b.contains("leading: driving replays"), "{log_b}");
    w.cleanup().await;
}

async fn deleting_a_replay_during_a_ten_minute_canary_wait_returns_within_seconds(c: &Cluster) {
    let w = World::new("ctl-canary-del").await;
    w.dead_letter((0..20).map(|i| job(&format!("w{i}"), json!({}))).collect())
        .await;
    // A worker that does the jobs: the canary does not come back, the wait runs its length.
    let _worker = w.worker(|_| false).await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let mut r = resource(&w, c.ns(), "wait", "");
    r.spec.canary.enabled = true;
    r.spec.canary.wait_seconds = 600;
    api.create(&PostParams::default(), &r).await.unwrap();
    let r = wait_for(&api, "wait", "Canary", |r| phase(r) == Some(Phase::Canary)).await;
    let out = r.status.unwrap().replay.canary.len() as u32;
    assert_eq!(out, 1, "one signature, one canary");
    api.delete("wait", &DeleteParams::default()).await.unwrap();
    let t = Instant::now();
    while api.get_opt("wait").await.unwrap().is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the replay task still waits on its canary 10 s after the delete"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "delete during a 600 s canary wait: gone after {} ms",
        t.elapsed().as_millis()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        w.depth(&w.topo.dlq).await,
        20 - out,
        "the DLQ lost more than the canary"
    );
    w.cleanup().await;
}

async fn suspending_during_the_canary_wait_says_so_and_resuming_sends_new_canaries(c: &Cluster) {
    let w = World::new("ctl-canary-sus").await;
    w.dead_letter((0..10).map(|i| job(&format!("u{i}"), json!({}))).collect())
        .await;
    let _worker = w.worker(|_| false).await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let mut r = resource(&w, c.ns(), "sw", "");
    r.spec.canary.enabled = true;
    r.spec.canary.wait_seconds = 600;
    api.create(&PostParams::default(), &r).await.unwrap();
    let first = wait_for(&api, "sw", "Canary", |r| phase(r) == Some(Phase::Canary)).await;
    let first = first.status.unwrap().replay.canary;
    suspend(&api, "sw", true).await;
    let t = Instant::now();
    let r = wait_for(&api, "sw", "Suspended", |r| {
        phase(r) == Some(Phase::Suspended)
    })
    .await;
    assert!(t.elapsed() < Duration::from_secs(10));
    // What the stop means for the canary that is out, and for the resume.
    let msg = r.status.and_then(|s| s.replay.message).unwrap_or_default();
    assert!(
        msg.contains("canary wait") && msg.contains("canary phase again"),
        "{msg}"
    );
    eprintln!(
        "suspend during a 600 s canary wait: Suspended after {} ms",
        t.elapsed().as_millis()
    );
    assert_eq!(w.depth(&w.topo.dlq).await, 9);
    suspend(&api, "sw", false).await;
    // The verdict of the first canary was not recorded: the resume sends a new one.
    let again = wait_for(&api, "sw", "a new canary", |r| {
        phase(r) == Some(Phase::Canary)
            && r.status.as_ref().is_some_and(|s| {
                s.canary.first().map(|c| &c.message_id) != first.first().map(|c| &c.message_id)
            })
    })
    .await;
    let s = again.status.unwrap();
    assert_eq!(s.counts.replayed, 2, "{s:?}");
    assert_eq!(w.depth(&w.topo.dlq).await, 8);
    w.cleanup().await;
}

async fn the_lease_is_taken_at_once_after_a_release_and_after_expiry_otherwise(c: &Cluster) {
    use dlq_replay::controller::lease::{Elector, LeaseConfig};
    let cfg = |who: &str| LeaseConfig {
        duration: Duration::from_secs(3),
        renew_deadline: Duration::from_secs(2),
        retry: Duration::from_millis(200),
        ..LeaseConfig::new("test-lease", c.ns(), who)
    };
    let mut a = Elector::new(c.client(), cfg("a"));
    let mut b = Elector::new(c.client(), cfg("b"));
    assert!(
        a.try_acquire_or_renew().await.unwrap(),
        "a free Lease is taken"
    );
    assert!(
        !b.try_acquire_or_renew().await.unwrap(),
        "a held Lease is not"
    );
    assert!(a.try_acquire_or_renew().await.unwrap(), "the holder renews");
    assert!(a.release().await.unwrap());
    assert!(
        b.try_acquire_or_renew().await.unwrap(),
        "a released Lease is taken at the next ask"
    );
    assert!(!a.try_acquire_or_renew().await.unwrap());
    // b stops renewing (as a replica that died): a takes over once the Lease expired, on its own
    // clock, and not before.
    let t = Instant::now();
    while !a.try_acquire_or_renew().await.unwrap() {
        assert!(t.elapsed() < Duration::from_secs(10), "never taken over");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        t.elapsed() >= Duration::from_millis(2800),
        "{:?}",
        t.elapsed()
    );
    let lease = c.get_json("leases", c.ns(), "test-lease").await.unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "a");
    assert_eq!(lease["spec"]["leaseTransitions"], 2, "{lease}");
    assert!(!b.try_acquire_or_renew().await.unwrap());
    assert!(b.renewal_overdue());
}

/// The shutdown figure at full speed: `cargo test --test controller -- --ignored --nocapture
/// sigterm_at_full_speed` (20,000 jobs, no rate limit, SIGTERM once 2,000 are replayed).
#[tokio::test]
#[ignore = "a measurement (about a minute): run it by name"]
async fn sigterm_at_full_speed() {
    use futures::FutureExt as _;
    let c = Cluster::fake().await;
    let result = AssertUnwindSafe(sigterm_mid_drain(&c, 20_000, "", 2_000))
        .catch_unwind()
        .await;
    c.cleanup().await;
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        /// The scenarios against the in-process fake API server.
        mod fake {
            use futures::FutureExt as _;
            $(
                #[tokio::test]
                async fn $name() {
                    let c = super::Cluster::fake().await;
                    let result = super::AssertUnwindSafe(super::$name(&c)).catch_unwind().await;
                    c.cleanup().await;
                    if let Err(panic) = result {
                        std::panic::resume_unwind(panic);
                    }
                }
            )*
        }

        /// The same scenarios against a real cluster (E2E=1 and KUBECONFIG), else SKIPPED.
        mod e2e {
            use futures::FutureExt as _;
            $(
                #[tokio::test]
                async fn $name() {
                    let Some(c) = super::Cluster::real(stringify!($name)).await else {
                        return;
                    };
                    let result = super::AssertUnwindSafe(super::$name(&c)).catch_unwind().await;
                    c.cleanup().await;
                    if let Err(panic) = result {
                        std::panic::resume_unwind(panic);
                    }
                }
            )*
        }
    };
}

scenarios!(
    apply_runs_the_replay_to_done_with_correct_counts_and_events,
    a_missing_secret_keeps_it_pending_until_the_secret_exists,
    an_evicting_redis_keeps_it_pending_until_its_policy_changes,
    a_second_replay_of_the_same_queue_waits_source_busy,
    suspend_pauses_after_in_flight_settles_and_resume_finishes,
    deleting_mid_drain_stops_cleanly_and_loses_nothing,
    an_operator_restart_mid_drain_resumes_and_loses_nothing,
    a_canary_that_dies_again_ends_canary_failed,
    a_failed_replay_is_retried_in_place_under_the_same_replay_id,
    a_canary_failed_replay_is_retried_in_place_with_new_canaries,
    with_two_replicas_only_the_leader_drives_replays,
    the_operator_binary_drives_a_replay_from_a_kubeconfig_and_serves_metrics,
    sigterm_to_the_leading_operator_mid_drain_exits_0_and_the_other_replica_finishes,
    deleting_a_replay_during_a_ten_minute_canary_wait_returns_within_seconds,
    suspending_during_the_canary_wait_says_so_and_resuming_sends_new_canaries,
    the_lease_is_taken_at_once_after_a_release_and_after_expiry_otherwise,
);
