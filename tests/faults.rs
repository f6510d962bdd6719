//! Faults that fit in CI's time, at small sizes: the scenarios of `make faults`
//! (tests/support/faults.rs). Each asserts the invariants message by message (nothing lost, no
//! key twice in Claim mode, counts and audit consistent) plus what is particular to its fault.
//! The broker restart (`rabbitmqctl stop_app`) is in `make faults` only: it would break every
//! other test running against the same broker.

mod support;

use std::path::Path;
use std::time::Duration;

use support::faults::{self, Tally};
use support::*;

const SEED: u64 = 20261202;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_dlq-replay"))
}

fn seed() -> u64 {
    let seed = std::env::var("FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEED);
    eprintln!("FAULT_SEED={seed}");
    seed
}

async fn check(w: World, t: Tally) -> Tally {
    t.assert_ok();
    w.cleanup().await;
    t
}

#[tokio::test]
async fn kill_9_in_claim_mode_loses_nothing_and_publishes_no_key_twice() {
    let w = World::new("kill-claim").await;
    let t = faults::kill_9(&w, bin(), "Claim", 3000, seed(), 4).await;
    assert!(t.runs >= 3, "{t:?}");
    check(w, t).await;
}

#[tokio::test]
async fn kill_9_in_check_mode_loses_nothing_and_republishes_at_most_the_window() {
    let w = World::new("kill-check").await;
    let t = faults::kill_9(&w, bin(), "Check", 3000, seed(), 4).await;
    check(w, t).await;
}

#[tokio::test]
async fn closed_broker_connections_are_reconnected_and_the_replay_finishes() {
    let w = World::new("cut").await;
    let t = faults::close_connection(&w, "Claim", 600, 300, 2, seed()).await;
    check(w, t).await;
}

#[tokio::test]
async fn with_reconnect_off_a_cut_connection_stops_the_replay_and_the_rerun_finishes_it() {
    let w = World::new("cut-off").await;
    faults::dead_letter_n(&w, 200).await;
    let resource = w.manifest(&format!(
        "{}  rate: {{messagesPerSecond: 100}}\n",
        w.idempotency("Claim")
    ));
    let opts = dlq_replay::engine::Options {
        reconnect: Duration::ZERO,
        ..Default::default()
    };
    let run = faults::spawn_engine(w.replay(&resource), opts);
    assert!(faults::until_depth(&w, &w.topo.work, 40, Duration::from_secs(60)).await);
    assert!(faults::close_connections(&w.tag) > 0);
    let status = run.await.unwrap().unwrap();
    assert_eq!(
        status.phase,
        Some(dlq_replay::api::Phase::Failed),
        "{status:?}"
    );
    let message = status.message.unwrap_or_default();
    assert!(
        message.contains("connection lost") && message.contains("run it again"),
        "{message}"
    );
    // The rerun finishes what the cut left: nothing lost, no key twice.
    let done = w.run(&resource).await;
    assert_eq!(done.phase, Some(dlq_replay::api::Phase::Done), "{done:?}");
    let audit = w.audit(&done).await;
    let mut problems = Vec::new();
    faults::verify(&done, &audit, &mut problems);
    assert!(problems.is_empty(), "{problems:?}");
    let places = faults::Places::collect(&w, &w.topo.work, &audit).await;
    assert_eq!(places.lost(200), 0, "{places:?}");
    assert_eq!(places.keys_twice, 0, "{places:?}");
    assert_eq!(places.unknown(), places.quarantine.len(), "{places:?}");
    w.cleanup().await;
}

#[tokio::test]
async fn a_paused_redis_holds_every_ack_and_publish_until_it_answers() {
    let w = World::new("rpause").await;
    let t = faults::redis_pause(&w, "Claim", 800, 100, Duration::from_secs(8)).await;
    check(w, t).await;
}

#[tokio::test]
async fn a_killed_redis_is_reconnected_after_its_restart() {
    let w = World::new("rkill").await;
    let t = faults::redis_restart(&w, "Claim", 600, 200, Duration::from_millis(1500)).await;
    check(w, t).await;
}

#[tokio::test]
async fn a_target_exchange_deleted_mid_drain_leaves_its_messages_failed_in_the_dlq() {
    let w = World::new("xdel").await;
    let t = faults::exchange_deleted(&w, "Claim", 300, 100).await;
    check(w, t).await;
}

#[tokio::test]
async fn a_full_target_queue_nacks_and_the_messages_stay_failed() {
    let w = World::new("nack").await;
    let t = faults::nacked(&w, "Claim", 6, 2).await;
    check(w, t).await;
}

#[tokio::test]
async fn poison_that_keeps_dying_is_quarantined_by_the_next_replay() {
    let w = World::new("loop").await;
    let t = faults::poison_loop(&w, 3).await;
    check(w, t).await;
}
