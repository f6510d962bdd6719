//! The canary on a DLQ fed through the default exchange, as Celery (and RabbitMQ's documentation
//! example) set it up: the work queue has `x-dead-letter-exchange: ""` and
//! `x-dead-letter-routing-key: <dlq>`, the DLQ is bound to nothing, and its deliveries carry the
//! exchange `""`. There is no dead-letter route for the return watch to bind to, so a canary's
//! return is found by the search of the watched queues when its wait ends (README, "The
//! canary"; `crates/engine/src/canary/search.rs`).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use dlq_replay::api::{CanaryResult, Phase};
use dlq_replay::engine::{self, message, Options};
use dlq_replay_testkit::world::*;
use lapin::options::{BasicGetOptions, BasicNackOptions};

use super::{
    assert_held_back_beside_the_returned_canary, canary_spec, recording_worker, run_with, typed,
};

/// A world whose work queue dead-letters through the default exchange.
async fn world(name: &str, t: &Target) -> World {
    World::on_with(name, t, |topo| topo.dead_letter_by_default_exchange()).await
}

/// The fixture did what this file is about: the DLQ's first message was delivered through the
/// default exchange (routing key: the DLQ's name) with the broker's own `x-death` naming the
/// work exchange and queue. It is looked at and handed back, on a channel of its own.
async fn assert_fed_by_default_exchange(w: &World) {
    let ch = w.conn.create_channel().await.unwrap();
    let m = ch
        .basic_get(
            w.topo.dlq.as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
        .expect("a dead letter in the DLQ");
    let d = &m.delivery;
    assert_eq!(
        d.exchange.as_str(),
        "",
        "delivered through the default exchange"
    );
    assert_eq!(d.routing_key.as_str(), w.topo.dlq);
    let props = (&d.properties).into();
    let deaths = message::deaths(&props);
    assert_eq!(deaths.len(), 1, "{deaths:?}");
    assert_eq!(deaths[0].reason, "rejected");
    assert_eq!(deaths[0].queue, w.topo.work);
    assert_eq!(deaths[0].exchange, w.topo.exchange);
    d.nack(BasicNackOptions {
        multiple: false,
        requeue: true,
    })
    .await
    .unwrap();
    let _ = ch.close(200, "ok".into()).await;
}

/// No dead-letter route was learnt for the DLQ: the return watch had nothing to bind to.
async fn assert_no_route_learnt(w: &World) {
    let key = engine::keep::ledger_key(w.amqp_url(), &w.topo.dlq).replacen(
        "dlq:moves:",
        "dlq:routes:",
        1,
    );
    let mut r = w.redis.clone();
    let routes: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&key)
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(routes.is_empty(), "{key}: {routes:?}");
}

matrix!(a_fixed_consumer_passes_the_canary_and_the_rest_drains);
async fn a_fixed_consumer_passes_the_canary_and_the_rest_drains(t: Target) {
    let w = world("dx-pass", &t).await;
    w.dead_letter(
        (0..10)
            .map(|i| typed(&format!("a{i}"), "TimeoutError"))
            .collect(),
    )
    .await;
    assert_fed_by_default_exchange(&w).await;
    let (_worker, received) = recording_worker(&w, &[]).await;
    let started = Instant::now();
    let status = run_with(&w, &canary_spec(&w, ""), Options::default()).await;
    let took = started.elapsed();
    eprintln!("{t}: pass in {took:?}");
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert!(
        took >= Duration::from_secs(5),
        "the canary wait was cut short"
    );
    assert_eq!(status.canary.len(), 1, "{:?}", status.canary);
    assert_eq!(status.canary[0].result, CanaryResult::Passed);
    assert_eq!(status.canary[0].messages, 10);
    assert_eq!(status.counts.replayed, 10, "{:?}", status.counts);
    assert_eq!(status.counts.returned, 0, "{:?}", status.counts);
    assert_sum(&status);
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    let audit = w.audit(&status).await;
    assert_eq!(audit.iter().filter(|r| r.canary).count(), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut got = received.lock().unwrap().clone();
    got.sort();
    let mut all: Vec<String> = (0..10).map(|i| format!("a{i}")).collect();
    all.sort();
    assert_eq!(got, all, "every job once, none twice");
    assert_no_route_learnt(&w).await;
    w.cleanup().await;
}

matrix!(a_still_broken_consumer_sends_the_canary_back_through_the_default_exchange);
async fn a_still_broken_consumer_sends_the_canary_back_through_the_default_exchange(t: Target) {
    let w = world("dx-fail", &t).await;
    w.dead_letter(
        (0..10)
            .map(|i| typed(&format!("b{i}"), "TimeoutError"))
            .collect(),
    )
    .await;
    let before = ids(&w.peek(&w.topo.dlq).await);
    assert_eq!(before.len(), 10);
    let (_worker, received) = recording_worker(&w, &["TimeoutError"]).await;
    let started = Instant::now();
    let status = run_with(&w, &canary_spec(&w, ""), Options::default()).await;
    let took = started.elapsed();
    eprintln!("{t}: CanaryFailed in {took:?}");
    assert_eq!(status.phase, Some(Phase::CanaryFailed), "{status:?}");
    assert_eq!(status.canary.len(), 1, "{:?}", status.canary);
    let c = &status.canary[0];
    assert_eq!(c.result, CanaryResult::DiedAgain, "{c:?}");
    assert!(
        c.reason.as_deref().unwrap_or_default().contains("rejected"),
        "{c:?}"
    );
    // No route to watch: the return is found by the search when the wait ends, not before.
    assert!(
        took >= Duration::from_secs(5),
        "decided before the wait ended: {took:?}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert_eq!(status.counts.replayed, 1, "{:?}", status.counts);
    assert_eq!(status.counts.returned, 1, "{:?}", status.counts);
    assert_sum(&status);
    // Every job is still in the DLQ, once: the nine never sent and the canary that came back.
    let after = w.peek(&w.topo.dlq).await;
    assert_eq!(after.len(), before.len(), "{:?}", ids(&after));
    assert_eq!(
        ids(&after).into_iter().collect::<HashSet<_>>(),
        before.iter().cloned().collect::<HashSet<_>>()
    );
    let returned: Vec<_> = after
        .iter()
        .filter(|m| header(m, "x-replay-id").is_some())
        .collect();
    assert_eq!(returned.len(), 1);
    assert_eq!(returned[0].id, c.message_id);
    assert_eq!(*received.lock().unwrap(), vec![c.message_id.clone()]);
    // A failed canary is final: running it again replays nothing.
    let again = run_with(&w, &canary_spec(&w, ""), Options::default()).await;
    assert_eq!(again.phase, Some(Phase::CanaryFailed), "{again:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        received.lock().unwrap().len(),
        1,
        "{:?}",
        received.lock().unwrap()
    );
    let last = ids(&w.peek(&w.topo.dlq).await);
    assert_eq!(last.len(), 10, "{last:?}");
    assert_eq!(
        last.into_iter().collect::<HashSet<_>>(),
        before.into_iter().collect::<HashSet<_>>()
    );
    assert_no_route_learnt(&w).await;
    w.cleanup().await;
}

matrix!(two_signatures_one_fixed_one_not_drain_only_the_fixed_one);
async fn two_signatures_one_fixed_one_not_drain_only_the_fixed_one(t: Target) {
    let w = world("dx-split", &t).await;
    let mut jobs: Vec<_> = (0..8)
        .map(|i| typed(&format!("t{i}"), "TimeoutError"))
        .collect();
    jobs.extend((0..4).map(|i| typed(&format!("k{i}"), "KeyError")));
    w.dead_letter(jobs).await;
    let before: Vec<_> = w
        .peek(&w.topo.dlq)
        .await
        .into_iter()
        .filter(|m| m.id.starts_with('k'))
        .collect();
    assert_eq!(ids(&before), ["k0", "k1", "k2", "k3"]);
    let (_worker, received) = recording_worker(&w, &["KeyError"]).await;
    let started = Instant::now();
    let status = run_with(&w, &canary_spec(&w, ", lookAhead: 3"), Options::default()).await;
    eprintln!("{t}: Done in {:?}", started.elapsed());
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    let results: BTreeMap<_, _> = status
        .canary
        .iter()
        .map(|c| (c.signature.as_str(), (c.message_id.as_str(), c.result)))
        .collect();
    assert_eq!(
        results["x-exception-type=TimeoutError"],
        ("t0", CanaryResult::Passed),
        "{:?}",
        status.canary
    );
    assert_eq!(
        results["x-exception-type=KeyError"],
        ("k0", CanaryResult::DiedAgain),
        "{:?}",
        status.canary
    );
    assert_eq!(status.counts.replayed, 8 + 1, "{:?}", status.counts);
    assert_eq!(status.counts.returned, 1, "{:?}", status.counts);
    assert_sum(&status);
    let msg = status.message.clone().unwrap_or_default();
    assert!(
        msg.contains("3 held back in the queue because the canary of their signature did not pass (x-exception-type=KeyError)"),
        "{msg}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut got = received.lock().unwrap().clone();
    got.sort();
    let mut sent: Vec<String> = (0..8).map(|i| format!("t{i}")).collect();
    sent.push("k0".into());
    sent.sort();
    assert_eq!(
        got, sent,
        "the fixed jobs and the KeyError canary, once each"
    );
    let returned = assert_held_back_beside_the_returned_canary(&w, &before[1..], "k0").await;
    assert_eq!(returned.body, before[0].body);
    assert_no_route_learnt(&w).await;
    w.cleanup().await;
}
