//! Messages the broker did not dead-letter the usual way: `x-death` missing or malformed, and a
//! `user-id` of another user. Each is replayed byte-identical or quarantined with a reason;
//! none is lost. (Bodies of every kind and every header value type: tests/engine.rs.)

use dlq_replay_testkit::world::*;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
use lapin::BasicProperties;
use serde_json::json;

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn table(entries: &[(&str, AMQPValue)]) -> AMQPValue {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert((*k).into(), v.clone());
    }
    AMQPValue::FieldTable(t)
}

/// Messages published straight into the DLQ, each with its own kind of broken `x-death`.
fn broken_deaths(work: &str) -> Vec<(&'static str, Option<AMQPValue>)> {
    let arr = |v: Vec<AMQPValue>| AMQPValue::FieldArray(FieldArray::from(v));
    vec![
        ("missing", None),
        ("a-string", Some(text("rejected"))),
        ("array-of-strings", Some(arr(vec![text("a"), text("b")]))),
        ("empty-array", Some(arr(vec![]))),
        (
            "count-is-text",
            Some(arr(vec![table(&[
                ("count", text("many")),
                ("queue", text(work)),
                ("reason", text("rejected")),
                ("exchange", text("")),
                ("routing-keys", arr(vec![text(work)])),
            ])])),
        ),
        (
            "no-queue-no-exchange",
            Some(arr(vec![table(&[("count", AMQPValue::LongLongInt(1))])])),
        ),
        (
            "huge-count",
            Some(arr(vec![table(&[
                ("count", AMQPValue::LongLongInt(i64::MAX)),
                ("queue", text(work)),
                ("reason", text("rejected")),
            ])])),
        ),
        (
            "queue-is-a-number",
            Some(arr(vec![table(&[
                ("count", AMQPValue::LongInt(1)),
                ("queue", AMQPValue::LongInt(7)),
                ("reason", AMQPValue::Boolean(true)),
            ])])),
        ),
    ]
}

async fn publish_broken(w: &World) -> Vec<String> {
    let ch = w.conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut ids = Vec::new();
    for (id, death) in broken_deaths(&w.topo.work) {
        let mut h = FieldTable::default();
        if let Some(d) = death {
            h.insert("x-death".into(), d);
        }
        let props = BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(h);
        ch.basic_publish(
            "".into(),
            w.topo.dlq.as_str().into(),
            BasicPublishOptions::default(),
            format!("{{\"id\":\"{id}\"}}").as_bytes(),
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
        ids.push(id.to_string());
    }
    ids
}

#[tokio::test]
async fn a_missing_or_malformed_x_death_is_quarantined_with_a_reason_never_lost() {
    let w = World::new("xdeath").await;
    let ids = publish_broken(&w).await;
    let before = by_id(&w.peek(&w.topo.dlq).await);
    let status = w.run(&w.manifest("  poison: {maxDeathCount: 5}\n")).await;
    assert_sum(&status);
    let replayed = by_id(&w.take(&w.topo.work).await);
    let quarantined = by_id(&w.take(&w.topo.quarantine).await);
    for id in &ids {
        let orig = &before[id];
        match (replayed.get(id), quarantined.get(id)) {
            (Some(m), None) => assert_eq!(m.body, orig.body, "{id}"),
            (None, Some(m)) => {
                let reason = header(m, "x-quarantine-reason").unwrap_or_default();
                assert!(!reason.is_empty(), "{id}: no reason");
                assert_eq!(m.body, orig.body, "{id}");
                // Quarantine keeps every header as it was, the broken x-death included.
                assert_eq!(
                    m.headers.inner().get("x-death"),
                    orig.headers.inner().get("x-death"),
                    "{id}"
                );
                eprintln!("{id}: quarantined: {reason}");
            }
            other => panic!("{id}: {other:?}"),
        }
    }
    // Without a usable x-death there is nowhere to send it back to: quarantined, saying so.
    assert!(header(&quarantined["missing"], "x-quarantine-reason")
        .unwrap()
        .starts_with("NoDestination"));
    // A count of i64::MAX deaths is poison by any maxDeathCount.
    assert!(header(&quarantined["huge-count"], "x-quarantine-reason")
        .unwrap()
        .starts_with("MaxDeathCount"));
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    w.cleanup().await;
}

#[tokio::test]
async fn with_an_explicit_target_a_malformed_x_death_is_replayed_byte_identical() {
    let w = World::new("xdeath-t").await;
    let ids = publish_broken(&w).await;
    let before = by_id(&w.peek(&w.topo.dlq).await);
    let status = w
        .run(&w.manifest(&format!(
            "  target: {{exchange: \"\", routingKey: {}}}\n  poison: {{maxDeathCount: 1000000}}\n",
            w.topo.work
        )))
        .await;
    let replayed = by_id(&w.take(&w.topo.work).await);
    let quarantined = by_id(&w.take(&w.topo.quarantine).await);
    // Every one but the i64::MAX-deaths message goes to the explicit target, body identical,
    // its broken x-death stripped like any death header.
    assert_eq!(status.counts.replayed as usize, ids.len() - 1, "{status:?}");
    assert!(quarantined.contains_key("huge-count"));
    for (id, m) in &replayed {
        assert_eq!(m.body, before[id].body, "{id}");
        assert!(!m.headers.contains_key("x-death"), "{id}");
    }
    w.cleanup().await;
}

/// Dead-letter `u0`..`u2` published by another user (so carrying `user-id: <that user>`, which
/// RabbitMQ refuses from anyone else) and `own`; returns that user, to delete afterwards.
async fn dead_letter_from_another_producer(w: &World) -> String {
    let user = format!("{}-producer", w.tag);
    let password = uuid::Uuid::new_v4().simple().to_string();
    must("rabbitmqctl", &["add_user", &user, &password]);
    must(
        "rabbitmqctl",
        &["set_permissions", "-p", "/", &user, ".*", ".*", ".*"],
    );
    let url = format!("amqp://{user}:{password}@127.0.0.1:5672/%2f");
    let producer = dlq_replay::fixture::connect(&url, "producer")
        .await
        .unwrap();
    let ch = producer.create_channel().await.unwrap();
    let mut jobs: Vec<_> = (0..3)
        .map(|i| {
            let (p, b) = job(&format!("u{i}"), json!({}));
            (p.with_user_id(user.as_str().into()), b)
        })
        .collect();
    jobs.push(job("own", json!({})));
    dlq_replay::fixture::dead_letter(&ch, &w.topo, jobs)
        .await
        .unwrap();
    let _ = producer.close(200, "bye".into()).await;
    user
}

#[tokio::test]
async fn a_user_id_of_another_producer_is_kept_in_a_header_and_the_replay_goes_on() {
    let w = World::new("userid").await;
    // The producer was another user: its messages carry `user-id: <that user>`, which RabbitMQ
    // refuses from anyone else.
    let user = dead_letter_from_another_producer(&w).await;
    let before = by_id(&w.peek(&w.topo.dlq).await);
    let status = w.run(&w.manifest("")).await;
    must("rabbitmqctl", &["delete_user", &user]);
    assert_eq!(status.counts.replayed, 4, "{status:?}");
    for m in w.take(&w.topo.work).await {
        assert_eq!(m.body, before[&m.id].body);
        if m.id == "own" {
            assert_eq!(m.props.user_id(), &None);
            continue;
        }
        assert_eq!(m.props.user_id(), &None, "{}", m.id);
        assert_eq!(
            header(&m, "x-original-user-id").as_deref(),
            Some(user.as_str())
        );
    }
    w.cleanup().await;
}

#[tokio::test]
async fn a_plan_over_another_producers_user_id_keeps_every_message() {
    let w = World::new("userid-plan").await;
    // A message is left in place by moving a copy to the DLQ's tail; RabbitMQ refuses a copy
    // carrying someone else's `user-id`, so the copy keeps it in a header instead.
    let user = dead_letter_from_another_producer(&w).await;
    let report = dlq_replay::engine::plan::plan(&w.replay(&w.manifest("")))
        .await
        .expect("plan");
    must("rabbitmqctl", &["delete_user", &user]);
    assert_eq!(report.counts.replayed, 4, "{report:?}");
    let after = w.take(&w.topo.dlq).await;
    assert_eq!(ids(&after), vec!["u0", "u1", "u2", "own"]);
    for m in &after[..3] {
        assert_eq!(m.props.user_id(), &None, "{}", m.id);
        assert_eq!(
            header(m, "x-original-user-id").as_deref(),
            Some(user.as_str())
        );
        assert!(m.headers.contains_key("x-death"), "{}", m.id);
    }
    w.cleanup().await;
}
