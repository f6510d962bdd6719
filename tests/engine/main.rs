//! The replay engine against the real RabbitMQ and Redis: decisions, invariants, headers.
//!
//! By concern: [`modes`] (Check and Claim mode end to end), [`plan`] (plans and dry runs),
//! [`drain`] (limits, routing, what passes through unchanged), [`expect`] (what a reviewer
//! approved); here the errors, and the test
//! kit's manifest resolution checked against the command line's.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dlq_replay::api::Phase;
use dlq_replay::fixture::Topology;
use dlq_replay_testkit::faults;
use dlq_replay_testkit::world::*;
use lapin::types::{AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString};
use lapin::BasicProperties;
use serde_json::json;

mod drain;
mod expect;
mod modes;
mod plan;

// Both brokers, classic only: the source queue does not exist, so there is no queue type to
// vary; what may differ is the broker's answer to the missing queue.
matrix!(a_missing_source_queue_is_a_clear_error_and_touches_nothing: classic_3_10, classic_4_x);
async fn a_missing_source_queue_is_a_clear_error_and_touches_nothing(t: Target) {
    let w = World::on("nosource", &t).await;
    let mut resource = w.manifest("");
    resource.spec.source.queue = format!("{}.missing", w.tag);
    let (tx, _rx) = tokio::sync::watch::channel(Default::default());
    let err = dlq_replay::engine::run(
        &w.replay(&resource),
        &Default::default(),
        &tx,
        &Default::default(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("spec.source.queue") && err.contains(".missing"),
        "{err}"
    );
    w.cleanup().await;
}

// RabbitMQ 3.10, classic only: the replay connects to port 1 (no broker) or to a Redis that is
// not there; the world's DLQ only shows that nothing moved, whatever its type.
#[tokio::test]
async fn an_unreachable_broker_or_redis_is_a_clear_error() {
    let w = World::new("unreachable").await;
    w.dead_letter(vec![job("a", json!({}))]).await;
    let resource = w.manifest("");
    let mut replay = w.replay(&resource);
    replay.amqp_url = "amqp://guest:hunter2-secret@127.0.0.1:1/%2f".into();
    let (tx, _rx) = tokio::sync::watch::channel(Default::default());
    let err = dlq_replay::engine::run(&replay, &Default::default(), &tx, &Default::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("broker: cannot connect"), "{err}");
    assert!(!err.contains("hunter2-secret"), "{err}");
    let mut replay = w.replay(&resource);
    replay.redis_url = "redis://:hunter2-secret@127.0.0.1:1/".into();
    let err = dlq_replay::engine::run(&replay, &Default::default(), &tx, &Default::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("redis:"), "{err}");
    assert!(!err.contains("hunter2-secret"), "{err}");
    assert_eq!(w.depth(&w.topo.dlq).await, 1);
    w.cleanup().await;
}

// Redis only: the world gives names, no queue is read.
#[tokio::test]
async fn the_store_notices_a_key_replayed_twice() {
    let w = World::new("again").await;
    let con = dlq_replay::engine::store::connect(redis_url())
        .await
        .unwrap();
    let audit = dlq_replay::engine::store::AuditConfig::default();
    let (mut store, _) =
        dlq_replay::engine::store::Store::begin(con, "tests", &w.tag, 1, "now", &audit)
            .await
            .unwrap();
    let mark = vec![(format!("key:{}", w.key("x")), "m1".to_string())];
    let (_, first) = store
        .commit(&[], &mark, &[], &Default::default())
        .await
        .unwrap();
    let (_, second) = store
        .commit(&[], &mark, &[], &Default::default())
        .await
        .unwrap();
    assert_eq!((first, second), (0, 1));
    w.cleanup().await;
}

// No broker and no Redis: the test kit resolves a world's manifest as `dlq-replay run -f` does
// with `REDIS_URL` set (`cli::resolve`, which the kit cannot call: the binary depends on the kit).
#[test]
fn the_test_kit_resolves_a_manifest_as_the_command_line_does() {
    let text = "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {name: kit, namespace: tests}\nspec:\n  broker: {url: \"amqp://guest:guest@127.0.0.1:5672/%2f\"}\n  source: {queue: kit.dlq}\n  quarantine: {queue: kit.quarantine}\n  idempotency: {mode: Claim, key: {fields: [{pointer: /id}], prefix: \"kit:\"}}\n";
    let resource = dlq_replay::manifest::parse(text).expect("manifest");
    let endpoints = dlq_replay::cli::Endpoints {
        amqp_url: None,
        redis_url: Some(redis_url().into()),
    };
    let cli = dlq_replay::cli::resolve(&resource, &endpoints).expect("cli::resolve");
    let kit = resolve(&resource, redis_url());
    assert_eq!(
        (
            &kit.namespace,
            &kit.name,
            &kit.amqp_url,
            &kit.redis_url,
            &kit.uid
        ),
        (
            &cli.namespace,
            &cli.name,
            &cli.amqp_url,
            &cli.redis_url,
            &cli.uid
        )
    );
    assert_eq!(format!("{:?}", kit.spec), format!("{:?}", cli.spec));
}
