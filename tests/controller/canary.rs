//! The canary under the operator: a canary that dies again, deletion and suspension during the
//! canary wait.

use super::*;

pub(crate) async fn a_canary_that_dies_again_ends_canary_failed(c: &Cluster) {
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

pub(crate) async fn deleting_a_replay_during_a_ten_minute_canary_wait_returns_within_seconds(
    c: &Cluster,
) {
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

pub(crate) async fn suspending_during_the_canary_wait_says_so_and_resuming_sends_new_canaries(
    c: &Cluster,
) {
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
        msg.contains("canary wait") && msg.contains("new canaries"),
        "{msg}"
    );
    eprintln!(
        "suspend during a 600 s canary wait: Suspended after {} ms",
        t.elapsed().as_millis()
    );
    assert_eq!(w.depth(&w.topo.dlq).await, 9);
    suspend(&api, "sw", false).await;
    // The first canary's verdict was not in: the resume sends a new one.
    let again = wait_for(&api, "sw", "a new canary", |r| {
        phase(r) == Some(Phase::Canary)
            && r.status.as_ref().is_some_and(|s| {
                s.canary.first().map(|c| &c.message_id) != first.first().map(|c| &c.message_id)
            })
    })
    .await;
    let s = again.status.unwrap();
    assert_eq!(s.counts.replayed, 2, "{s:?}");
    // The other 8 wait for the new canary: set aside by the replay (unacked, not ready) and
    // handed back when it stops.
    assert_eq!(
        s.message.as_deref().map(|m| m.contains("set aside")),
        Some(true),
        "{s:?}"
    );
    w.cleanup().await;
}
