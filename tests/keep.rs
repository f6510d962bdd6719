//! Leaving messages in place on every broker and queue type: what a pass does not take is moved
//! to the DLQ's tail (confirmed copy, then ack), never handed back, so no quorum-queue delivery
//! count grows, no prefetch or consumer timeout caps a pass, and a copy a crash left twice is
//! dropped once.

use std::time::Duration;

use dlq_replay::api::Phase;
use dlq_replay::engine::keep;
use dlq_replay_testkit::world::*;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use serde_json::json;

/// Publish `n` messages straight into the DLQ (as dead letters that arrived through the default
/// exchange), confirmed; `daily(i)` says which carry `"show": "daily"`.
async fn fill(w: &World, n: usize, daily: impl Fn(usize) -> bool) {
    let ch = w.conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(2000) {
        for &i in chunk {
            let show = if daily(i) { "daily" } else { "weekly" };
            let body = json!({"id": format!("m{i}"), "show": show}).to_string();
            let mut h = FieldTable::default();
            h.insert("x-exception-type".into(), AMQPValue::LongString("E".into()));
            let props = BasicProperties::default()
                .with_message_id(format!("m{i}").into())
                .with_delivery_mode(2)
                .with_headers(h);
            ch.basic_publish(
                "".into(),
                w.topo.dlq.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await
            .unwrap();
        }
        ch.wait_for_confirms().await.unwrap();
    }
    let _ = ch.close(200, "ok".into()).await;
}

/// The message ids of a queue, in order, taken out by a consumer (fast, for big queues).
async fn drain_ids(w: &World, queue: &str) -> Vec<String> {
    let expected = w.depth(queue).await as usize;
    let ch = w.conn.create_channel().await.unwrap();
    ch.basic_qos(2000, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "drain".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut ids = Vec::with_capacity(expected);
    while ids.len() < expected {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        ids.push(
            d.properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string())
                .unwrap_or_default(),
        );
        if ids.len() % 1000 == 0 || ids.len() == expected {
            d.ack(BasicAckOptions { multiple: true }).await.unwrap();
        }
    }
    let _ = ch.close(200, "ok".into()).await;
    ids
}

// Two cases, not four: each moves 70,000 messages, and what it proves (no prefetch cap) is the
// same on both queue types; the quorum case is the one a delivery limit would have hurt, and the
// one where acks applied late once left the pass's last batch twice in the DLQ.
matrix!(a_selector_that_skips_more_than_65535_messages_finishes_in_one_run: classic_3_10, quorum_4_x);
async fn a_selector_that_skips_more_than_65535_messages_finishes_in_one_run(t: Target) {
    let w = World::on("skip70k", &t).await;
    let n = 70_000;
    let daily = |i: usize| i % 1000 == 7;
    fill(&w, n, daily).await;
    let spec = format!(
        "  target: {{exchange: {x}, routingKey: job}}\n  selector:\n    payload: [{{pointer: /show, equals: daily}}]\n",
        x = w.topo.exchange
    );
    let status = w.run(&w.manifest(&spec)).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert_eq!(status.counts.scanned, n as u64, "{status:?}");
    assert_eq!(status.counts.replayed, 70, "{status:?}");
    assert_eq!(status.counts.skipped, (n - 70) as u64, "{status:?}");
    assert_sum(&status);
    let expected: Vec<String> = (0..n)
        .filter(|&i| !daily(i))
        .map(|i| format!("m{i}"))
        .collect();
    assert_eq!(w.depth(&w.topo.work).await, 70);
    let left = drain_ids(&w, &w.topo.dlq).await;
    assert!(
        left == expected,
        "the skipped messages are not all there in order: {} of {}",
        left.len(),
        expected.len()
    );
    w.cleanup().await;
}

matrix!(a_canary_watching_while_dead_letters_keep_arriving_hands_nothing_back);
async fn a_canary_watching_while_dead_letters_keep_arriving_hands_nothing_back(t: Target) {
    // On RabbitMQ 3.10 a quorum queue has no delivery limit unless given one: give it a small
    // one, so that three hand-backs would drop a message. RabbitMQ 4 has 20 by default.
    let w = World::on_with("watch", &t, |topo| {
        if t.is_quorum() && t.broker.is_v3_10() {
            topo.delivery_limit(Some(3))
        } else {
            topo
        }
    })
    .await;
    w.dead_letter((0..10).map(|i| job(&format!("j{i}"), json!({}))).collect())
        .await;
    let worker = w.worker(|_| false).await;
    // Unrelated dead letters arrive through the dead-letter exchange all through the canary's
    // wait; each grows the DLQ, which is what made the canary search (and hand back) it before.
    let arrivals = {
        let ch = w.conn.create_channel().await.unwrap();
        let dlx = w.topo.dlx.clone();
        tokio::spawn(async move {
            for i in 0..24 {
                let mut h = FieldTable::default();
                h.insert(
                    "x-exception-type".into(),
                    AMQPValue::LongString("OtherError".into()),
                );
                let props = BasicProperties::default()
                    .with_message_id(format!("late{i}").into())
                    .with_headers(h);
                ch.basic_publish(
                    dlx.as_str().into(),
                    "".into(),
                    BasicPublishOptions::default(),
                    b"{}",
                    props,
                )
                .await
                .unwrap();
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let spec = "  canary: {enabled: true, waitSeconds: 5}\n  selector:\n    headers: {x-exception-type: TimeoutError}\n";
    let status = w.run(&w.manifest(spec)).await;
    arrivals.await.unwrap();
    worker.abort();
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert_eq!(status.counts.replayed, 10, "{status:?}");
    assert_sum(&status);
    let mut left = ids(&w.take(&w.topo.dlq).await);
    left.sort();
    let mut late: Vec<String> = (0..24).map(|i| format!("late{i}")).collect();
    late.sort();
    assert_eq!(left, late, "every late dead letter is still in the DLQ");
    w.cleanup().await;
}

matrix!(a_copy_a_crash_left_twice_is_dropped_once_by_the_next_traversal);
async fn a_copy_a_crash_left_twice_is_dropped_once_by_the_next_traversal(t: Target) {
    let w = World::on("leftover", &t).await;
    w.dead_letter((0..5).map(|i| job(&format!("j{i}"), json!({}))).collect())
        .await;
    // What a crash between a move's confirm and the original's ack leaves: the message twice
    // (its copy at the tail) and the ledger counting it.
    let before = w.take(&w.topo.dlq).await;
    for m in before.iter().chain(std::iter::once(&before[2])) {
        w.ch.basic_publish(
            "".into(),
            w.topo.dlq.as_str().into(),
            BasicPublishOptions::default(),
            &m.body,
            m.props.clone(),
        )
        .await
        .unwrap();
    }
    let ledger = keep::ledger_key(w.amqp_url(), &w.topo.dlq);
    let digest = keep::digest(&(&before[2].props).into(), &before[2].body);
    let mut r = w.redis.clone();
    redis::cmd("HINCRBY")
        .arg(&ledger)
        .arg(&digest)
        .arg(1)
        .query_async::<()>(&mut r)
        .await
        .unwrap();
    // A message the ledger does not count is never dropped, even when it is there twice.
    w.ch.basic_publish(
        "".into(),
        w.topo.dlq.as_str().into(),
        BasicPublishOptions::default(),
        &before[4].body,
        before[4].props.clone(),
    )
    .await
    .unwrap();
    assert!(
        dlq_replay_testkit::faults::until_depth(&w, &w.topo.dlq, 7, Duration::from_secs(5)).await
    );
    let report = dlq_replay::engine::plan::plan(&w.replay(&w.manifest("")))
        .await
        .expect("plan");
    assert_eq!(report.depth, 7);
    let after = w.take(&w.topo.dlq).await;
    assert_eq!(ids(&after), vec!["j0", "j1", "j2", "j3", "j4", "j4"]);
    for (a, b) in after.iter().zip(&before) {
        assert_eq!((&a.body, &a.headers), (&b.body, &b.headers), "{}", a.id);
    }
    let left: std::collections::HashMap<String, i64> = redis::cmd("HGETALL")
        .arg(&ledger)
        .query_async(&mut r)
        .await
        .unwrap();
    // The leftover's count is settled; what may stay is the count of the traversal's last
    // message, whose ack the close does not wait for (the next traversal settles it).
    assert!(!left.contains_key(&digest), "{left:?}");
    let last = keep::digest(&(&before[4].props).into(), &before[4].body);
    assert!(left.keys().all(|d| *d == last), "{left:?}");
    w.cleanup().await;
}
