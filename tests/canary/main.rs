//! The canary with real consumers on the work queue; `default_exchange`: on a DLQ fed through
//! the default exchange.

mod default_exchange;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use dlq_replay::api::{CanaryResult, Phase, ReplayStatus};
use dlq_replay::engine::{self, message, Options};
use dlq_replay_testkit::faults;
use dlq_replay_testkit::world::*;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicRejectOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// A worker on the work queue: fails (rejects into the DLQ) the exception types in `fail`,
/// processes the rest, and marks their key done when `mark_done`.
async fn worker(w: &World, fail: &[&str], mark_done: bool) -> tokio::task::JoinHandle<()> {
    worker_timed(w, fail, mark_done, Default::default(), Duration::ZERO).await
}

type Rejections = std::sync::Arc<std::sync::Mutex<Vec<Instant>>>;

async fn worker_timed(
    w: &World,
    fail: &[&str],
    mark_done: bool,
    rejected: Rejections,
    think: Duration,
) -> tokio::task::JoinHandle<()> {
    let ch = w.conn.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            w.topo.work.as_str().into(),
            "test-worker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let fail: HashSet<String> = fail.iter().map(|s| s.to_string()).collect();
    let mut redis = w.redis.clone();
    tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let kind = message::header_text(&(&d.properties).into(), "x-exception-type")
                .unwrap_or_default();
            tokio::time::sleep(think).await;
            if fail.contains(&kind) {
                d.reject(BasicRejectOptions { requeue: false })
                    .await
                    .unwrap();
                rejected.lock().unwrap().push(Instant::now());
                continue;
            }
            if mark_done {
                if let Some(k) =
                    message::header_text(&(&d.properties).into(), message::IDEMPOTENCY_KEY)
                {
                    let _: () = redis::cmd("SET")
                        .arg(k)
                        .arg("done")
                        .arg("EX")
                        .arg(600)
                        .query_async(&mut redis)
                        .await
                        .unwrap();
                }
            }
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    })
}

fn typed(id: &str, kind: &str) -> (lapin::BasicProperties, Vec<u8>) {
    let (p, b) = job(id, json!({}));
    let mut h = p.headers().clone().unwrap();
    h.insert(
        "x-exception-type".into(),
        AMQPValue::LongString(kind.into()),
    );
    (p.with_headers(h), b)
}

fn canary_spec(w: &World, extra: &str) -> String {
    format!(
        "{}  canary: {{enabled: true, waitSeconds: 5{extra}}}\n",
        w.idempotency("Check")
    )
}

async fn run_with(w: &World, spec: &str, opts: Options) -> ReplayStatus {
    let resource = w.manifest(spec);
    let (tx, _rx) = tokio::sync::watch::channel(ReplayStatus::default());
    engine::run(&w.replay(&resource), &opts, &tx, &CancellationToken::new())
        .await
        .unwrap()
}

matrix!(a_fixed_consumer_passes_the_canary_and_the_rest_drains);
async fn a_fixed_consumer_passes_the_canary_and_the_rest_drains(t: Target) {
    let w = World::on("canary-pass", &t).await;
    w.dead_letter(
        (0..10)
            .map(|i| typed(&format!("a{i}"), "TimeoutError"))
            .collect(),
    )
    .await;
    let _worker = worker(&w, &[], false).await;
    let t = Instant::now();
    let status = run_with(&w, &canary_spec(&w, ""), Options::default()).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert!(
        t.elapsed() >= Duration::from_secs(5),
        "the canary wait was cut short"
    );
    assert_eq!(status.canary.len(), 1);
    assert_eq!(status.canary[0].result, CanaryResult::Passed);
    assert_eq!(status.canary[0].messages, 10);
    assert_eq!(status.counts.replayed, 10);
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    let audit = w.audit(&status).await;
    assert_eq!(audit.iter().filter(|r| r.canary).count(), 1);
    w.cleanup().await;
}

matrix!(a_still_broken_consumer_sends_the_canary_back_and_nothing_else_moves);
async fn a_still_broken_consumer_sends_the_canary_back_and_nothing_else_moves(t: Target) {
    let w = World::on("canary-fail", &t).await;
    w.dead_letter(
        (0..8)
            .map(|i| typed(&format!("b{i}"), "TimeoutError"))
            .collect(),
    )
    .await;
    let before = ids(&w.peek(&w.topo.dlq).await);
    let rejections = Rejections::default();
    // The worker takes a second per job, so the canary dies in the middle of the wait.
    let _worker = worker_timed(
        &w,
        &["TimeoutError"],
        false,
        rejections.clone(),
        Duration::from_millis(1130),
    )
    .await;
    let t = Instant::now();
    let resource = w.manifest(&canary_spec(&w, ""));
    let (tx, mut rx) = tokio::sync::watch::channel(ReplayStatus::default());
    let seen_at = tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            if rx
                .borrow()
                .canary
                .iter()
                .any(|c| c.result == CanaryResult::DiedAgain)
            {
                return Some(Instant::now());
            }
        }
        None
    });
    let status = engine::run(
        &w.replay(&resource),
        &Options::default(),
        &tx,
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    drop(tx);
    let detected = t.elapsed();
    if let (Some(seen), Some(died)) = (
        seen_at.await.unwrap(),
        rejections.lock().unwrap().first().copied(),
    ) {
        eprintln!(
            "canary return detected {} ms after its dead-lettering",
            seen.duration_since(died).as_millis()
        );
    }
    assert_eq!(status.phase, Some(Phase::CanaryFailed), "{status:?}");
    let c = &status.canary[0];
    assert_eq!(c.result, CanaryResult::DiedAgain);
    assert!(c.reason.as_deref().unwrap().contains("rejected"), "{c:?}");
    // Detected when it came back, not at the end of the wait.
    assert!(detected < Duration::from_secs(5), "took {detected:?}");
    assert!(
        detected >= Duration::from_secs(1),
        "detected before the worker failed it: {detected:?}"
    );
    // The DLQ holds everything it held: the untouched rest, plus the returned canary.
    let after = w.peek(&w.topo.dlq).await;
    assert_eq!(after.len(), before.len());
    let returned: Vec<_> = after
        .iter()
        .filter(|m| header(m, "x-replay-id").is_some())
        .collect();
    assert_eq!(returned.len(), 1);
    assert_eq!(returned[0].id, c.message_id);
    assert_eq!(
        ids(&after).into_iter().collect::<HashSet<_>>(),
        before.into_iter().collect()
    );
    // A failed canary is final: running it again replays nothing.
    let again = run_with(&w, &canary_spec(&w, ""), Options::default()).await;
    assert_eq!(again.phase, Some(Phase::CanaryFailed));
    returned_to_dlq(&w, 8).await;
    w.cleanup().await;
}

matrix!(two_signatures_one_fixed_one_not_drain_only_the_fixed_one);
async fn two_signatures_one_fixed_one_not_drain_only_the_fixed_one(t: Target) {
    let w = World::on("canary-split", &t).await;
    let mut jobs: Vec<_> = (0..6)
        .map(|i| typed(&format!("t{i}"), "TimeoutError"))
        .collect();
    jobs.extend((0..4).map(|i| typed(&format!("k{i}"), "KeyError")));
    w.dead_letter(jobs).await;
    let _worker = worker(&w, &["KeyError"], false).await;
    let status = run_with(&w, &canary_spec(&w, ""), Options::default()).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    let by_sig: std::collections::BTreeMap<_, _> = status
        .canary
        .iter()
        .map(|c| (c.signature.clone(), c.result))
        .collect();
    assert_eq!(
        by_sig["x-exception-type=TimeoutError"],
        CanaryResult::Passed
    );
    assert_eq!(by_sig["x-exception-type=KeyError"], CanaryResult::DiedAgain);
    assert_eq!(
        status.counts.replayed,
        6 + 1,
        "6 TimeoutError + the KeyError canary"
    );
    // The 3 held-back KeyError jobs and the returned canary stay in the DLQ.
    let left = w.peek(&w.topo.dlq).await;
    assert_eq!(left.len(), 4);
    assert!(left
        .iter()
        .all(|m| header(m, "x-exception-type").as_deref() == Some("KeyError")));
    assert_eq!(status.counts.returned, 1);
    w.cleanup().await;
}

/// When a canary went out (its `sentAt`).
fn sent_at(status: &ReplayStatus, sig: &str) -> chrono::DateTime<chrono::FixedOffset> {
    let c = status
        .canary
        .iter()
        .find(|c| c.signature == sig)
        .unwrap_or_else(|| panic!("no canary for {sig}: {:?}", status.canary));
    chrono::DateTime::parse_from_rfc3339(c.sent_at.as_deref().unwrap()).unwrap()
}

matrix!(a_signature_first_met_past_the_look_ahead_gets_its_canary_when_met);
async fn a_signature_first_met_past_the_look_ahead_gets_its_canary_when_met(t: Target) {
    let w = World::on("canary-deep-sig", &t).await;
    let mut jobs: Vec<_> = (0..10)
        .map(|i| typed(&format!("t{i}"), "TimeoutError"))
        .collect();
    jobs.extend((0..3).map(|i| typed(&format!("k{i}"), "KeyError")));
    w.dead_letter(jobs).await;
    let _worker = worker(&w, &[], false).await;
    let status = run_with(&w, &canary_spec(&w, ", lookAhead: 3"), Options::default()).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert_eq!(status.counts.replayed, 13, "{:?}", status.counts);
    assert_eq!(status.canary.len(), 2, "{:?}", status.canary);
    assert!(status
        .canary
        .iter()
        .all(|c| c.result == CanaryResult::Passed));
    let (timeout, key) = (
        sent_at(&status, "x-exception-type=TimeoutError"),
        sent_at(&status, "x-exception-type=KeyError"),
    );
    // KeyError lies past the first look-ahead: its canary left when the drain met it, after the
    // TimeoutError canary's 5 s wait let the drain go on.
    assert!(
        key - timeout >= chrono::Duration::milliseconds(4500),
        "KeyError's canary at {key}, TimeoutError's at {timeout}"
    );
    let by_sig: std::collections::BTreeMap<_, _> = status
        .canary
        .iter()
        .map(|c| (c.signature.as_str(), (c.message_id.as_str(), c.messages)))
        .collect();
    assert_eq!(by_sig["x-exception-type=TimeoutError"], ("t0", 10));
    assert_eq!(by_sig["x-exception-type=KeyError"], ("k0", 3));
    let audit = w.audit(&status).await;
    let canaries: Vec<&str> = audit
        .iter()
        .filter(|r| r.canary)
        .map(|r| r.message.as_str())
        .collect();
    assert_eq!(canaries, ["t0", "k0"]);
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    w.cleanup().await;
}

matrix!(a_canary_that_returns_while_others_were_proven_holds_only_its_signature);
async fn a_canary_that_returns_while_others_were_proven_holds_only_its_signature(t: Target) {
    let w = World::on("canary-late-fail", &t).await;
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
    let _worker = worker(&w, &["KeyError"], false).await;
    let status = run_with(&w, &canary_spec(&w, ", lookAhead: 3"), Options::default()).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    let results: std::collections::BTreeMap<_, _> = status
        .canary
        .iter()
        .map(|c| (c.signature.as_str(), c.result))
        .collect();
    assert_eq!(
        results["x-exception-type=TimeoutError"],
        CanaryResult::Passed
    );
    assert_eq!(
        results["x-exception-type=KeyError"],
        CanaryResult::DiedAgain
    );
    assert_eq!(status.counts.replayed, 8 + 1, "{:?}", status.counts);
    assert_eq!(status.counts.returned, 1, "{:?}", status.counts);
    let msg = status.message.clone().unwrap_or_default();
    assert!(
        msg.contains("3 held back in the queue because the canary of their signature did not pass (x-exception-type=KeyError)"),
        "{msg}"
    );
    assert_held_back_beside_the_returned_canary(&w, &before[1..], "k0").await;
    w.cleanup().await;
}

/// What a failed canary leaves in the DLQ: its signature's other messages, `held`, byte for byte
/// and in their order (moved to the tail, never replayed), and the canary that came back (this
/// replay's `x-replay-id` on it), which is returned.
async fn assert_held_back_beside_the_returned_canary(
    w: &World,
    held: &[Seen],
    canary: &str,
) -> Seen {
    let after = w.peek(&w.topo.dlq).await;
    let (returned, kept): (Vec<Seen>, Vec<Seen>) = after
        .into_iter()
        .partition(|m| header(m, "x-replay-id").is_some());
    assert_eq!(kept, held.to_vec());
    assert_eq!(returned.len(), 1, "{:?}", ids(&returned));
    assert_eq!(returned[0].id, canary);
    returned.into_iter().next().unwrap()
}

matrix!(stop_replay_ends_the_replay_at_a_returned_canary);
async fn stop_replay_ends_the_replay_at_a_returned_canary(t: Target) {
    let w = World::on("canary-stop", &t).await;
    let mut jobs = Vec::new();
    for i in 0..4 {
        jobs.push(typed(&format!("t{i}"), "TimeoutError"));
        jobs.push(typed(&format!("k{i}"), "KeyError"));
    }
    w.dead_letter(jobs).await;
    let before = ids(&w.peek(&w.topo.dlq).await);
    let _worker = worker(&w, &["KeyError"], false).await;
    let started = Instant::now();
    let status = run_with(
        &w,
        &canary_spec(&w, ", onFailure: StopReplay"),
        Options::default(),
    )
    .await;
    assert_eq!(status.phase, Some(Phase::CanaryFailed), "{status:?}");
    let msg = status.message.clone().unwrap_or_default();
    assert!(msg.contains("StopReplay"), "{msg}");
    // Both canaries left together; KeyError's came back long before TimeoutError's wait ended.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(status.counts.replayed, 2, "{:?}", status.counts);
    // Everything else is in the DLQ, with the returned canary.
    let after = ids(&w.peek(&w.topo.dlq).await);
    let expected: HashSet<String> = before.into_iter().filter(|id| id != "t0").collect();
    assert_eq!(after.into_iter().collect::<HashSet<_>>(), expected);
    w.cleanup().await;
}

matrix!(no_consumer_keeps_the_replay_pending_and_touches_nothing);
async fn no_consumer_keeps_the_replay_pending_and_touches_nothing(t: Target) {
    let w = World::on("canary-pending", &t).await;
    w.dead_letter(
        (0..5)
            .map(|i| typed(&format!("p{i}"), "TimeoutError"))
            .collect(),
    )
    .await;
    let before = w.peek(&w.topo.dlq).await;
    let opts = Options {
        pending_timeout: Some(Duration::from_secs(1)),
        recheck: Duration::from_millis(300),
        ..Options::default()
    };
    let status = run_with(&w, &canary_spec(&w, ""), opts).await;
    assert_eq!(status.phase, Some(Phase::Pending), "{status:?}");
    assert!(
        status.message.as_deref().unwrap().contains("NoConsumer"),
        "{status:?}"
    );
    // Handed back as they were. A RabbitMQ 4 quorum queue puts what is handed back behind the
    // rest (and counts a delivery); every other queue keeps its order.
    let mut after = w.peek(&w.topo.dlq).await;
    let mut before = before;
    if t.is_quorum() && !t.broker.is_v3_10() {
        after.sort_by(|a, b| a.id.cmp(&b.id));
        before.sort_by(|a, b| a.id.cmp(&b.id));
    }
    assert_eq!(after, before);
    assert_eq!(w.depth(&w.topo.work).await, 0);
    assert_eq!(status.counts.scanned, 0);
    w.cleanup().await;
}

/// The DLQ holds `n` messages once what the replay left unacked is back: a quorum queue counts
/// deliveries a closed channel hands back milliseconds after the replay returns (seen on RabbitMQ
/// 3.10: 1 of 3 at once, 3 after 6 ms).
async fn returned_to_dlq(w: &World, n: u32) {
    faults::until_depth(w, &w.topo.dlq, n as usize, Duration::from_secs(5)).await;
    assert_eq!(w.depth(&w.topo.dlq).await, n);
}

matrix!(require_done_does_not_pass_a_consumer_that_silently_drops);
async fn require_done_does_not_pass_a_consumer_that_silently_drops(t: Target) {
    let w = World::on("canary-done", &t).await;
    w.dead_letter(
        (0..4)
            .map(|i| typed(&format!("d{i}"), "TimeoutError"))
            .collect(),
    )
    .await;
    // Acks without doing the work (never marks the key done).
    let _worker = worker(&w, &[], false).await;
    let status = run_with(
        &w,
        &canary_spec(&w, ", requireDone: true"),
        Options::default(),
    )
    .await;
    assert_eq!(status.phase, Some(Phase::CanaryFailed), "{status:?}");
    assert_eq!(status.canary[0].result, CanaryResult::Unconfirmed);
    returned_to_dlq(&w, 3).await;
    w.cleanup().await;
}

matrix!(a_worker_that_marks_done_confirms_the_canary_before_the_wait_ends);
async fn a_worker_that_marks_done_confirms_the_canary_before_the_wait_ends(t: Target) {
    let w = World::on("canary-confirm", &t).await;
    w.dead_letter(
        (0..4)
            .map(|i| typed(&format!("e{i}"), "TimeoutError"))
            .collect(),
    )
    .await;
    let _worker = worker(&w, &[], true).await;
    let t = Instant::now();
    let status = run_with(
        &w,
        &canary_spec(&w, ", requireDone: true"),
        Options::default(),
    )
    .await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert_eq!(status.canary[0].result, CanaryResult::Confirmed);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(status.counts.replayed, 4);
    w.cleanup().await;
}

matrix!(too_much_poison_stops_before_draining);
async fn too_much_poison_stops_before_draining(t: Target) {
    let w = World::on("canary-poison", &t).await;
    let mut jobs: Vec<_> = (0..3)
        .map(|i| typed(&format!("g{i}"), "TimeoutError"))
        .collect();
    for i in 0..3 {
        let (p, _) = typed(&format!("x{i}"), "TimeoutError");
        jobs.push((p, b"garbage".to_vec()));
    }
    w.dead_letter(jobs).await;
    let _worker = worker(&w, &[], false).await;
    let spec = format!(
        "  poison: {{requiredFields: [/id], maxQuarantineRatio: 0.2}}\n{}",
        canary_spec(&w, "")
    );
    let status = run_with(&w, &spec, Options::default()).await;
    assert_eq!(status.phase, Some(Phase::Failed), "{status:?}");
    assert!(status
        .message
        .as_deref()
        .unwrap()
        .contains("maxQuarantineRatio"));
    returned_to_dlq(&w, 6).await;
    w.cleanup().await;
}

matrix!(more_signatures_than_max_signatures_fail_before_anything_moves);
async fn more_signatures_than_max_signatures_fail_before_anything_moves(t: Target) {
    let w = World::on("canary-sigs", &t).await;
    // An exception header holding per-message text: every message its own signature.
    let jobs = (0..6)
        .map(|i| typed(&format!("s{i}"), &format!("job s{i} timed out after {i}0s")))
        .collect();
    w.dead_letter(jobs).await;
    let _worker = worker(&w, &[], false).await;
    let status = run_with(
        &w,
        &canary_spec(&w, ", maxSignatures: 4"),
        Options::default(),
    )
    .await;
    assert_eq!(status.phase, Some(Phase::Failed), "{status:?}");
    let why = status.message.as_deref().unwrap_or_default();
    assert!(why.starts_with("TooManySignatures:"), "{why}");
    assert!(why.contains("canary.maxSignatures 4"), "{why}");
    assert!(status.canary.is_empty(), "no canary may leave: {status:?}");
    returned_to_dlq(&w, 6).await;
    assert_eq!(w.depth(&w.topo.work).await, 0);
    w.cleanup().await;
}

matrix!(returns_while_draining_above_the_ratio_stop_the_replay);
async fn returns_while_draining_above_the_ratio_stop_the_replay(t: Target) {
    let w = World::on("canary-returns", &t).await;
    w.dead_letter(
        (0..60)
            .map(|i| typed(&format!("r{i:02}"), "TimeoutError"))
            .collect(),
    )
    .await;
    // The canary (r00) goes through; then half the jobs die again: the fix covers only some.
    let _worker = w
        .worker(|d| {
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string())
                .unwrap_or_default();
            id.trim_start_matches('r').parse::<u32>().unwrap_or(0) % 2 == 1
        })
        .await;
    let spec = format!(
        "{}  rate: {{messagesPerSecond: 20}}\n",
        canary_spec(&w, ", maxReturnRatio: 0.2")
    );
    let status = run_with(&w, &spec, Options::default()).await;
    assert_eq!(status.phase, Some(Phase::Failed), "{status:?}");
    let msg = status.message.clone().unwrap();
    assert!(
        msg.starts_with("TooManyReturns") && msg.contains("rejected"),
        "{msg}"
    );
    let c = status.counts;
    assert!(c.returned as f64 > 0.2 * c.replayed as f64, "{c:?}");
    assert!(c.replayed < 60, "it did not stop: {c:?}");
    // Nothing lost: what was not replayed is still in the DLQ, with the returns behind it.
    let dlq = w.peek(&w.topo.dlq).await;
    let returned = dlq
        .iter()
        .filter(|m| header(m, "x-replay-id").is_some())
        .count() as u64;
    assert_eq!(dlq.len() as u64 - returned, 60 - c.replayed, "{c:?}");
    w.cleanup().await;
}

/// The message ids a worker received, in order.
type Received = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// A worker on the work queue that records every message id it receives: fails (rejects into
/// the DLQ) the exception types in `fail`, processes (acks) the rest.
async fn recording_worker(w: &World, fail: &[&str]) -> (tokio::task::JoinHandle<()>, Received) {
    let ch = w.conn.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            w.topo.work.as_str().into(),
            "test-recorder".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let fail: HashSet<String> = fail.iter().map(|s| s.to_string()).collect();
    let received = Received::default();
    let got = received.clone();
    let handle = tokio::spawn(async move {
        let _keep = ch;
        while let Some(Ok(d)) = consumer.next().await {
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string())
                .unwrap_or_default();
            got.lock().unwrap().push(id);
            let kind = message::header_text(&(&d.properties).into(), "x-exception-type")
                .unwrap_or_default();
            if fail.contains(&kind) {
                d.reject(BasicRejectOptions { requeue: false })
                    .await
                    .unwrap();
            } else {
                d.ack(BasicAckOptions::default()).await.unwrap();
            }
        }
    });
    (handle, received)
}

matrix!(a_kill_9_during_a_canary_wait_resumes_without_sending_proven_canaries_again);
async fn a_kill_9_during_a_canary_wait_resumes_without_sending_proven_canaries_again(t: Target) {
    let w = World::on("canary-kill", &t).await;
    let mut jobs: Vec<_> = (0..6)
        .map(|i| typed(&format!("t{i}"), "TimeoutError"))
        .collect();
    jobs.extend((0..4).map(|i| typed(&format!("k{i}"), "KeyError")));
    w.dead_letter(jobs).await;
    let (_worker, got) = recording_worker(&w, &[]).await;
    let resource = w.manifest(&format!(
        "{}  canary: {{enabled: true, waitSeconds: 5, lookAhead: 3}}\n",
        w.idempotency("Claim")
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replay.yaml");
    std::fs::write(&file, serde_yaml::to_string(&resource).unwrap()).unwrap();
    let cli = || {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"));
        cmd.args(["run", "--no-progress", "-o", "json", "-f"])
            .arg(&file)
            .env("REDIS_URL", redis_url())
            .env_remove("AMQP_URL")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        cmd
    };
    // TimeoutError's canary passes, its messages drain; KeyError, past the look-ahead, gets its
    // canary when the drain meets it: kill -9 in the middle of that wait.
    let mut child = cli().spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !got.lock().unwrap().iter().any(|id| id == "k0") {
        assert!(
            Instant::now() < deadline,
            "k0 never arrived: {:?}",
            got.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "it ended before the kill"
    );
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let out = cli().output().await.unwrap();
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let status: ReplayStatus = serde_json::from_value(printed["status"].clone()).unwrap();
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut received = got.lock().unwrap().clone();
    received.sort();
    let mut all: Vec<String> = (0..6)
        .map(|i| format!("t{i}"))
        .chain((0..4).map(|i| format!("k{i}")))
        .collect();
    all.sort();
    assert_eq!(received, all, "every job once, none twice");
    // The proven signature's canary went once; KeyError's, out at the kill, went again (the
    // next KeyError job), and both its canaries are in the audit trail.
    let audit = w.audit(&status).await;
    let canaries: Vec<&str> = audit
        .iter()
        .filter(|r| r.canary)
        .map(|r| r.message.as_str())
        .collect();
    assert_eq!(canaries, ["t0", "k0", "k1"], "{audit:?}");
    let results: Vec<_> = status
        .canary
        .iter()
        .map(|c| (c.message_id.as_str(), c.result))
        .collect();
    assert_eq!(
        results,
        [("t0", CanaryResult::Passed), ("k1", CanaryResult::Passed)]
    );
    w.cleanup().await;
}

matrix!(a_pending_pre_flight_holds_the_look_ahead_and_goes_on_when_it_passes);
async fn a_pending_pre_flight_holds_the_look_ahead_and_goes_on_when_it_passes(t: Target) {
    let w = World::on("canary-pending-go", &t).await;
    w.dead_letter(
        (0..5)
            .map(|i| typed(&format!("q{i}"), "TimeoutError"))
            .collect(),
    )
    .await;
    let resource = w.manifest(&canary_spec(&w, ""));
    let replay = w.replay(&resource);
    let (tx, mut rx) = tokio::sync::watch::channel(ReplayStatus::default());
    let opts = Options {
        recheck: Duration::from_millis(300),
        ..Options::default()
    };
    let run =
        tokio::spawn(
            async move { engine::run(&replay, &opts, &tx, &CancellationToken::new()).await },
        );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = rx.borrow_and_update().clone();
        if s.phase == Some(Phase::Pending)
            && s.message
                .as_deref()
                .is_some_and(|m| m.contains("NoConsumer"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "never Pending: {s:?}");
        let _ = tokio::time::timeout(Duration::from_millis(200), rx.changed()).await;
    }
    // Several failed checks later the look-ahead is still held, not handed back at each one (on
    // a quorum queue every hand-back counts a delivery): the queue shows only the pass's last
    // message ready.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(w.depth(&w.topo.dlq).await, 1, "the look-ahead went back");
    }
    let (_worker, got) = recording_worker(&w, &[]).await;
    let status = run.await.unwrap().unwrap();
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert_eq!(status.counts.replayed, 5, "{:?}", status.counts);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut ids = got.lock().unwrap().clone();
    ids.sort();
    assert_eq!(ids, ["q0", "q1", "q2", "q3", "q4"]);
    w.cleanup().await;
}
