//! Faults that fit in CI's time, at small sizes: the scenarios of `make faults`
//! (crates/testkit/src/faults.rs). Each asserts the invariants message by message (nothing lost, no
//! key twice in Claim mode, counts and audit consistent) plus what is particular to its fault.
//! The broker restart (`rabbitmqctl stop_app`) is in `make faults` only: it would break every
//! other test running against the same broker.
//!
//! Each scenario runs over the matrix (RabbitMQ 3.10 and 4.x × classic and quorum queues; see
//! crates/testkit/src/world), the Redis faults on two cases only: what they break is Redis, not the
//! broker, so RabbitMQ 3.10 classic and 4.x quorum cover both brokers and both queue types.

use std::path::Path;
use std::time::Duration;

use dlq_replay_testkit::faults::{self, Tally};
use dlq_replay_testkit::world::*;

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
    eprintln!("on {}", w.target);
    t.assert_ok();
    w.cleanup().await;
    t
}

matrix!(kill_9_in_claim_mode_loses_nothing_and_publishes_no_key_twice);
async fn kill_9_in_claim_mode_loses_nothing_and_publishes_no_key_twice(target: Target) {
    let w = World::on("kill-claim", &target).await;
    let t = faults::kill_9(&w, bin(), "Claim", 3000, seed(), 4).await;
    assert!(t.runs >= 3, "{t:?}");
    check(w, t).await;
}

matrix!(kill_9_in_check_mode_loses_nothing_and_republishes_at_most_the_window);
async fn kill_9_in_check_mode_loses_nothing_and_republishes_at_most_the_window(target: Target) {
    let w = World::on("kill-check", &target).await;
    let t = faults::kill_9(&w, bin(), "Check", 3000, seed(), 4).await;
    check(w, t).await;
}

matrix!(closed_broker_connections_are_reconnected_and_the_replay_finishes);
async fn closed_broker_connections_are_reconnected_and_the_replay_finishes(target: Target) {
    let w = World::on("cut", &target).await;
    let t = faults::close_connection(&w, "Claim", 600, 300, 2, seed()).await;
    check(w, t).await;
}

matrix!(with_reconnect_off_a_cut_connection_stops_the_replay_and_the_rerun_finishes_it);
async fn with_reconnect_off_a_cut_connection_stops_the_replay_and_the_rerun_finishes_it(
    target: Target,
) {
    let w = World::on("cut-off", &target).await;
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
    assert!(faults::close_connections(&w) > 0);
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

matrix!(a_paused_redis_holds_every_ack_and_publish_until_it_answers: classic_3_10, quorum_4_x);
async fn a_paused_redis_holds_every_ack_and_publish_until_it_answers(target: Target) {
    let w = World::on("rpause", &target).await;
    // A quorum DLQ's total takes two rabbitmqctl runs (up to ~12 s a look on a loaded machine,
    // booting an Erlang VM each, in the RabbitMQ 4 chroot): both looks must fit inside the pause,
    // and the second begins at half of it. 14 s was seen overrun (the second look ending at
    // 23.8 s) while the suite ran beside a build.
    let pause = Duration::from_secs(if target.is_quorum() { 36 } else { 8 });
    let t = faults::redis_pause(&w, "Claim", 800, 100, pause).await;
    check(w, t).await;
}

matrix!(a_killed_redis_is_reconnected_after_its_restart: classic_3_10, quorum_4_x);
async fn a_killed_redis_is_reconnected_after_its_restart(target: Target) {
    let w = World::on("rkill", &target).await;
    let t = faults::redis_restart(&w, "Claim", 600, 200, Duration::from_millis(1500)).await;
    check(w, t).await;
}

matrix!(a_target_exchange_deleted_mid_drain_leaves_its_messages_failed_in_the_dlq);
async fn a_target_exchange_deleted_mid_drain_leaves_its_messages_failed_in_the_dlq(target: Target) {
    let w = World::on("xdel", &target).await;
    let t = faults::exchange_deleted(&w, "Claim", 300, 100).await;
    check(w, t).await;
}

matrix!(a_full_target_queue_nacks_and_the_messages_stay_failed);
async fn a_full_target_queue_nacks_and_the_messages_stay_failed(target: Target) {
    let w = World::on("nack", &target).await;
    let t = faults::nacked(&w, "Claim", 6, 2).await;
    check(w, t).await;
}

matrix!(poison_that_keeps_dying_is_quarantined_by_the_next_replay);
async fn poison_that_keeps_dying_is_quarantined_by_the_next_replay(target: Target) {
    let w = World::on("loop", &target).await;
    let t = faults::poison_loop(&w, 3).await;
    check(w, t).await;
}
