//! A Failed or CanaryFailed replay retried in place by the `replay.dlq.dev/retry` annotation, and
//! the expiry of its Redis keys.

use super::*;

/// `rabbitmqctl close_connection` on every broker connection of the replay `ns/name` (named
/// `dlq-replay NS/NAME ROLE`); returns how many there were.
pub(crate) fn close_replay_connections(w: &World, ns: &str, name: &str) -> usize {
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
pub(crate) async fn ttls(w: &World, r: &DlqReplay) -> Vec<(String, i64)> {
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

pub(crate) async fn annotate_retry(api: &Api<DlqReplay>, name: &str, value: &str) {
    let patch = json!({"metadata": {"annotations": {dlq_replay::api::RETRY_ANNOTATION: value}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// A replay that ends `Failed` (the broker went away for longer than the reconnect budget,
/// here 0 s) is retried in place by the `replay.dlq.dev/retry` annotation: same replay id, it
/// resumes where it stopped and ends Done, each key published once. A Done replay is not
/// retried (a Warning Event says why). Its Redis keys expire within its retention.
pub(crate) async fn a_failed_replay_is_retried_in_place_under_the_same_replay_id(c: &Cluster) {
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
pub(crate) async fn a_canary_failed_replay_is_retried_in_place_with_new_canaries(c: &Cluster) {
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
