//! The real kube-runtime Controller against the in-process fake API server, with the real
//! RabbitMQ and Redis, through whole lifecycles.

mod support;

use std::time::{Duration, Instant};

use dlq_replay::api::{DlqReplay, Phase};
use dlq_replay::controller::{self, Settings};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use support::fake_api::FakeApi;
use support::*;

const NS: &str = "replays";

fn resource(w: &World, name: &str, extra: &str) -> DlqReplay {
    let text = format!(
        "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {{name: {name}, namespace: {NS}}}\nspec:\n  broker: {{urlSecretRef: {{name: rabbitmq, key: url}}}}\n  source: {{queue: {dlq}}}\n  quarantine: {{queue: {q}}}\n  audit: {{redis: {{urlSecretRef: {{name: redis, key: url}}}}}}\n  canary: {{enabled: false}}\n{extra}",
        dlq = w.topo.dlq,
        q = w.topo.quarantine,
    );
    dlq_replay::manifest::parse(&text).unwrap_or_else(|e| panic!("{e}"))
}

fn secrets(api: &FakeApi) {
    api.put_secret(NS, "rabbitmq", &[("url", AMQP)]);
    api.put_secret(NS, "redis", &[("url", REDIS)]);
}

fn operator(
    api: &FakeApi,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let settings = Settings {
        status_interval: Duration::from_millis(500),
        ..Settings::default()
    };
    let handle = tokio::spawn(controller::run_until(api.client(), settings, async move {
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

fn phase(r: &DlqReplay) -> Option<Phase> {
    r.status.as_ref().and_then(|s| s.phase)
}

/// What `kubectl get dlqreplays` prints, from the CRD's printer columns.
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

#[tokio::test]
async fn apply_runs_the_replay_to_done_with_correct_counts_and_events() {
    let w = World::new("ctl-done").await;
    let mut jobs: Vec<_> = (0..30).map(|i| job(&format!("j{i}"), json!({}))).collect();
    let mut bad = job("bad", json!({}));
    bad.1 = b"nope".to_vec();
    jobs.push(bad);
    w.dead_letter(jobs).await;
    w.set(&w.key("j0"), "done").await;
    let fake = FakeApi::start().await;
    secrets(&fake);
    let (_op, _stop) = operator(&fake);
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    let extra = format!(
        "  poison: {{requiredFields: [/id]}}\n{}  rate: {{messagesPerSecond: 20}}\n",
        w.idempotency("Check")
    );
    api.create(&PostParams::default(), &resource(&w, "done", &extra))
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
    assert!(r.finalizers().iter().any(|f| f == controller::FINALIZER));
    // 29 replays at 20/s is about 1.5 s: throttled to a write per 0.5 s, not one per message.
    let writes = fake.status_writes(NS, "done");
    assert!(writes < 15, "{writes} status writes");
    let reasons: Vec<String> = fake
        .events()
        .iter()
        .filter_map(|e| e["reason"].as_str().map(String::from))
        .collect();
    assert!(
        reasons.contains(&"Draining".to_string()) && reasons.contains(&"Done".to_string()),
        "{reasons:?}"
    );
    eprintln!("$ kubectl get dlqreplays -n {NS}\n{}", kubectl_get(&[r]));
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

#[tokio::test]
async fn a_missing_secret_keeps_it_pending_until_the_secret_exists() {
    let w = World::new("ctl-secret").await;
    w.dead_letter((0..5).map(|i| job(&format!("s{i}"), json!({}))).collect())
        .await;
    let fake = FakeApi::start().await;
    let (_op, _stop) = operator(&fake);
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    api.create(&PostParams::default(), &resource(&w, "sec", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "sec", "Pending", |r| phase(r) == Some(Phase::Pending)).await;
    let msg = r.status.unwrap().message.unwrap();
    assert!(
        msg.contains("SecretMissing") && msg.contains("rabbitmq"),
        "{msg}"
    );
    assert_eq!(w.depth(&w.topo.dlq).await, 5);
    secrets(&fake);
    let r = wait_for(&api, "sec", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 5);
    // No password in status or events.
    let dump = format!(
        "{:?}{:?}",
        api.get("sec").await.unwrap().status,
        fake.events()
    );
    assert!(!dump.contains("guest:guest"), "a URL password leaked");
    w.cleanup().await;
}

#[tokio::test]
async fn a_second_replay_of_the_same_queue_waits_source_busy() {
    let w = World::new("ctl-busy").await;
    w.dead_letter((0..40).map(|i| job(&format!("b{i}"), json!({}))).collect())
        .await;
    let fake = FakeApi::start().await;
    secrets(&fake);
    let (_op, _stop) = operator(&fake);
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    api.create(
        &PostParams::default(),
        &resource(&w, "first", "  rate: {messagesPerSecond: 20}\n"),
    )
    .await
    .unwrap();
    wait_for(&api, "first", "Draining", |r| {
        phase(r) == Some(Phase::Draining)
    })
    .await;
    api.create(&PostParams::default(), &resource(&w, "second", ""))
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

#[tokio::test]
async fn suspend_pauses_after_in_flight_settles_and_resume_finishes() {
    let w = World::new("ctl-suspend").await;
    w.dead_letter((0..60).map(|i| job(&format!("p{i}"), json!({}))).collect())
        .await;
    let fake = FakeApi::start().await;
    secrets(&fake);
    let (_op, _stop) = operator(&fake);
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    api.create(
        &PostParams::default(),
        &resource(&w, "sus", "  rate: {messagesPerSecond: 20}\n"),
    )
    .await
    .unwrap();
    wait_for(&api, "sus", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    api.patch(
        "sus",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": true}})),
    )
    .await
    .unwrap();
    let r = wait_for(&api, "sus", "Suspended", |r| {
        phase(r) == Some(Phase::Suspended)
    })
    .await;
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
    api.patch(
        "sus",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": false}})),
    )
    .await
    .unwrap();
    let r = wait_for(&api, "sus", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 60);
    assert_eq!(w.take(&w.topo.work).await.len(), 60);
    w.cleanup().await;
}

#[tokio::test]
async fn deleting_mid_drain_stops_cleanly_and_loses_nothing() {
    let w = World::new("ctl-delete").await;
    w.dead_letter((0..60).map(|i| job(&format!("d{i}"), json!({}))).collect())
        .await;
    let fake = FakeApi::start().await;
    secrets(&fake);
    let (_op, _stop) = operator(&fake);
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    api.create(
        &PostParams::default(),
        &resource(&w, "del", "  rate: {messagesPerSecond: 20}\n"),
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
    w.cleanup().await;
}

#[tokio::test]
async fn an_operator_restart_mid_drain_resumes_and_loses_nothing() {
    let w = World::new("ctl-restart").await;
    w.dead_letter((0..60).map(|i| job(&format!("r{i}"), json!({}))).collect())
        .await;
    let fake = FakeApi::start().await;
    secrets(&fake);
    let (op, stop) = operator(&fake);
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    let extra = format!(
        "{}  rate: {{messagesPerSecond: 20}}\n",
        w.idempotency("Claim")
    );
    api.create(&PostParams::default(), &resource(&w, "rst", &extra))
        .await
        .unwrap();
    let before = wait_for(&api, "rst", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    let id = before.status.unwrap().replay_id;
    stop.send(()).unwrap();
    op.await.unwrap();
    let (_op2, _stop2) = operator(&fake);
    let r = wait_for(&api, "rst", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = r.status.unwrap();
    assert_eq!(s.replay_id, id, "a restart must resume the same replay");
    let target = w.take(&w.topo.work).await;
    let keys: std::collections::BTreeSet<_> = target
        .iter()
        .filter_map(|m| header(m, "x-idempotency-key"))
        .collect();
    assert_eq!(keys.len(), target.len(), "a key was published twice");
    assert_eq!(
        target.len() as u64 + w.depth(&w.topo.quarantine).await as u64,
        60,
        "{s:?}"
    );
    w.cleanup().await;
}

#[tokio::test]
async fn a_canary_that_dies_again_ends_canary_failed() {
    let w = World::new("ctl-canary").await;
    w.dead_letter((0..6).map(|i| job(&format!("c{i}"), json!({}))).collect())
        .await;
    // A worker that still fails every job.
    let ch = w.conn.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            w.topo.work.as_str().into(),
            "still-broken".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    tokio::spawn(async move {
        use futures::StreamExt;
        while let Some(Ok(d)) = consumer.next().await {
            let _ = d
                .reject(lapin::options::BasicRejectOptions { requeue: false })
                .await;
        }
    });
    let fake = FakeApi::start().await;
    secrets(&fake);
    let (_op, _stop) = operator(&fake);
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    let mut r = resource(&w, "can", "");
    r.spec.canary.enabled = true;
    r.spec.canary.wait_seconds = 5;
    api.create(&PostParams::default(), &r).await.unwrap();
    let r = wait_for(&api, "can", "CanaryFailed", |r| {
        phase(r) == Some(Phase::CanaryFailed)
    })
    .await;
    let s = r.status.unwrap();
    assert_eq!(s.canary[0].result, dlq_replay::api::CanaryResult::DiedAgain);
    assert_eq!(w.depth(&w.topo.dlq).await, 6);
    assert!(fake
        .events()
        .iter()
        .any(|e| e["reason"] == "CanaryFailed" && e["type"] == "Warning"));
    w.cleanup().await;
}

#[tokio::test]
async fn with_two_replicas_only_the_leader_drives_replays() {
    let w = World::new("ctl-leader").await;
    w.dead_letter((0..30).map(|i| job(&format!("l{i}"), json!({}))).collect())
        .await;
    let fake = FakeApi::start().await;
    secrets(&fake);
    let replicas: Vec<_> = ["op-a", "op-b"]
        .iter()
        .map(|id| {
            let settings = Settings {
                instance: id.to_string(),
                status_interval: Duration::from_millis(500),
                ..Settings::default()
            };
            let client = fake.client();
            tokio::spawn(async move {
                let metrics = dlq_replay::metrics::Metrics::global();
                let _ =
                    controller::run_with_leader_election(client, settings, "dlq-replay", metrics)
                        .await;
            })
        })
        .collect();
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    let extra = format!(
        "{}  rate: {{messagesPerSecond: 30}}\n",
        w.idempotency("Claim")
    );
    api.create(&PostParams::default(), &resource(&w, "lead", &extra))
        .await
        .unwrap();
    let r = wait_for(&api, "lead", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 30);
    let target = w.take(&w.topo.work).await;
    assert_eq!(target.len(), 30, "published by both replicas?");
    let lease = fake
        .get_json("leases", "dlq-replay", "dlq-replay-leader")
        .expect("a Lease");
    let holder = lease["spec"]["holderIdentity"]
        .as_str()
        .unwrap()
        .to_string();
    let instances: std::collections::BTreeSet<String> = fake
        .events()
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

#[tokio::test]
async fn the_operator_binary_drives_a_replay_from_a_kubeconfig_and_serves_metrics() {
    let w = World::new("ctl-binary").await;
    w.dead_letter((0..200).map(|i| job(&format!("o{i}"), json!({}))).collect())
        .await;
    let fake = FakeApi::start().await;
    secrets(&fake);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: \"{}\"}}}}]\nusers: [{{name: fake, user: {{}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: default}}}}]\ncurrent-context: fake\n",
            fake.url()
        ),
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"))
        .args([
            "operator",
            "--namespace",
            NS,
            "--http-addr",
            &format!("127.0.0.1:{port}"),
            "--lease-namespace",
            NS,
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
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    api.create(
        &PostParams::default(),
        &resource(&w, "bin", "  rate: {messagesPerSecond: 100}\n"),
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
        metrics.contains("dlq_replay_messages_total{decision=\"replayed\"} 200"),
        "{metrics}"
    );
    assert!(metrics.contains("dlq_replay_leader 1"), "{metrics}");
    assert_eq!(w.take(&w.topo.work).await.len(), 200);
    let _ = child.kill().await;
    w.cleanup().await;
}
