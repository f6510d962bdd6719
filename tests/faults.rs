//! Faults that fit in CI's time: nacked publishes, a cut broker connection, poison that keeps
//! coming back.

mod support;

use std::time::Duration;

use dlq_replay::api::Phase;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;
use support::*;

#[tokio::test]
async fn a_full_target_queue_nacks_and_the_messages_stay_failed() {
    let w = World::new("nack").await;
    w.dead_letter((0..6).map(|i| job(&format!("n{i}"), json!({}))).collect())
        .await;
    let full = format!("{}.full", w.tag);
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(2));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    w.ch.queue_declare(full.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    let status = w
        .run(&w.manifest(&format!(
            "  target: {{exchange: \"\", routingKey: {full}}}\n"
        )))
        .await;
    let c = status.counts;
    assert_eq!((c.replayed, c.failed), (2, 4), "{c:?}");
    assert_eq!(w.depth(&w.topo.dlq).await, 4);
    assert!(w
        .audit(&status)
        .await
        .iter()
        .filter(|r| r.decision == "failed")
        .all(|r| r.reason.starts_with("Nacked")));
    let _ =
        w.ch.queue_delete(full.as_str().into(), Default::default())
            .await;
    w.cleanup().await;
}

#[tokio::test]
async fn poison_that_keeps_dying_is_quarantined_by_the_next_replay() {
    let w = World::new("loop").await;
    w.dead_letter((0..3).map(|i| job(&format!("p{i}"), json!({}))).collect())
        .await;
    // A worker that still fails these jobs.
    let _worker = w.worker(|_| true).await;
    let first = w.run(&w.manifest("  poison: {maxDeathCount: 1}\n")).await;
    assert_eq!(first.counts.replayed, 3);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let back = w.peek(&w.topo.dlq).await;
    assert_eq!(back.len(), 3);
    assert!(back
        .iter()
        .all(|m| header(m, "x-replay-count").as_deref() == Some("1")));
    // A second replay (a new one) sees 1 new death + 1 replay = 2 > maxDeathCount: the loop ends.
    let mut second = w.manifest("  poison: {maxDeathCount: 1}\n");
    second.metadata.name = Some(format!("{}-2", w.tag));
    let status = w.run(&second).await;
    assert_eq!(
        (status.counts.quarantined, status.counts.replayed),
        (3, 0),
        "{status:?}"
    );
    let q = w.take(&w.topo.quarantine).await;
    assert!(q.iter().all(|m| header(m, "x-quarantine-reason")
        .unwrap()
        .starts_with("MaxDeathCount")));
    w.cleanup().await;
}

#[tokio::test]
async fn a_closed_broker_connection_stops_the_replay_and_the_rerun_finishes_it() {
    let w = World::new("cut").await;
    w.dead_letter(
        (0..80)
            .map(|i| job(&format!("c{i:02}"), json!({})))
            .collect(),
    )
    .await;
    let resource = w.manifest(&format!(
        "{}  rate: {{messagesPerSecond: 40}}\n",
        w.idempotency("Claim")
    ));
    let replay = w.replay(&resource);
    let run = tokio::spawn(async move { run_replay(&replay).await });
    tokio::time::sleep(Duration::from_millis(800)).await;
    let name = format!("dlq-replay tests/{} source", w.tag);
    let conns = std::process::Command::new("rabbitmqctl")
        .args(["list_connections", "pid", "client_properties", "-q"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&conns.stdout);
    let pid = text
        .lines()
        .find(|l| l.contains(&name))
        .and_then(|l| l.split_whitespace().next())
        .expect("our connection")
        .to_string();
    let closed = std::process::Command::new("rabbitmqctl")
        .args(["close_connection", &pid, "fault test"])
        .output()
        .unwrap();
    assert!(
        closed.status.success(),
        "{}",
        String::from_utf8_lossy(&closed.stderr)
    );
    let status = run.await.unwrap();
    assert_eq!(status.phase, Some(Phase::Failed), "{status:?}");
    assert!(
        status.message.as_deref().unwrap().contains("run it again"),
        "{status:?}"
    );
    // Nothing acked whose outcome was not durable: the rerun finishes, no key twice, none lost.
    let done = w.run(&resource).await;
    assert_eq!(done.phase, Some(Phase::Done), "{done:?}");
    let target = w.take(&w.topo.work).await;
    assert_each_key_once(&target);
    let quarantined = w.take(&w.topo.quarantine).await;
    assert!(quarantined.iter().all(|m| header(m, "x-quarantine-reason")
        .unwrap()
        .starts_with("OutcomeUnknown")));
    let mut ids: std::collections::BTreeSet<String> = target.iter().map(|m| m.id.clone()).collect();
    ids.extend(quarantined.iter().map(|m| m.id.clone()));
    assert_eq!(ids.len(), 80, "lost messages");
    w.cleanup().await;
}
