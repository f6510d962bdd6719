//! Fault scenarios, shared by `tests/faults.rs` (at sizes that fit CI) and `make faults`
//! (`examples/faults.rs`, at full size, printing the table).
//!
//! Each scenario dead-letters its own messages (ids `f00000`…), breaks something while a real
//! replay drains them, lets the replay (or its rerun) finish, then finds every message again —
//! in the target, the quarantine queue, the DLQ, or dropped as a duplicate with its audit row —
//! and checks the counts against the audit trail. The result is a [`Tally`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dlq_replay_api::{Phase, ReplayStatus};
use dlq_replay_engine::{self as engine, store, Options, Replay};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::world::*;

mod broker;
mod nodes;
mod redis_faults;
mod run;

pub use broker::*;
pub use nodes::*;
pub use redis_faults::*;
pub use run::*;

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Tally {
    pub fault: String,
    /// Runs of the replay (a kill -9 ends one; a reconnect does not).
    pub runs: usize,
    pub messages: usize,
    /// Messages found nowhere afterwards: must be 0.
    pub lost: usize,
    /// Idempotency keys found in the target more than once: must be 0 in Claim mode.
    pub twice: usize,
    pub mode: &'static str,
    /// What else the scenario saw (quarantined OutcomeUnknown, failed, phase...).
    pub detail: String,
    /// Invariants that did not hold (empty when all did).
    pub problems: Vec<String>,
}

impl Tally {
    pub fn ok(&self) -> bool {
        self.lost == 0 && (self.mode != "Claim" || self.twice == 0) && self.problems.is_empty()
    }

    pub fn assert_ok(&self) {
        assert!(self.ok(), "{self:#?}");
        eprintln!("{}", self.line());
    }

    pub fn header() -> String {
        format!(
            "{:<44} {:>5} {:>6} {:>8} {:>5} {:>11}  {}",
            "fault", "mode", "runs", "messages", "lost", "keys twice", "detail"
        )
    }

    pub fn line(&self) -> String {
        format!(
            "{:<44} {:>5} {:>6} {:>8} {:>5} {:>11}  {}{}",
            self.fault,
            self.mode,
            self.runs,
            self.messages,
            self.lost,
            self.twice,
            self.detail,
            if self.problems.is_empty() {
                String::new()
            } else {
                format!("  PROBLEMS: {}", self.problems.join("; "))
            }
        )
    }
}

/// Where every message went.
#[derive(Default, Debug)]
pub struct Places {
    /// Message id → copies in the target.
    pub target: BTreeMap<String, usize>,
    /// The target's message ids in the order the queue gave them.
    pub target_order: Vec<String>,
    pub keys_twice: usize,
    pub quarantine: BTreeMap<String, String>,
    pub dlq: BTreeSet<String>,
    pub duplicates: BTreeSet<String>,
    pub failed_reasons: Vec<String>,
}

impl Places {
    /// Take the target and the quarantine, look at the DLQ, read the audit trail.
    pub async fn collect(w: &World, target: &str, audit: &[store::AuditRow]) -> Self {
        let mut p = Places::default();
        let mut keys: BTreeMap<String, usize> = BTreeMap::new();
        for m in w.take(target).await {
            if let Some(k) = header(&m, "x-idempotency-key") {
                *keys.entry(k).or_default() += 1;
            }
            p.target_order.push(m.id.clone());
            *p.target.entry(m.id).or_default() += 1;
        }
        p.keys_twice = keys.values().filter(|&&n| n > 1).count();
        for m in w.take(&w.topo.quarantine).await {
            let reason = header(&m, "x-quarantine-reason").unwrap_or_default();
            p.quarantine.insert(m.id, reason);
        }
        p.dlq = ids(&w.peek(&w.topo.dlq).await).into_iter().collect();
        for r in audit {
            match r.decision.as_str() {
                "duplicate" => {
                    p.duplicates.insert(r.message.clone());
                }
                "failed" => p.failed_reasons.push(r.reason.clone()),
                _ => {}
            }
        }
        p
    }

    pub fn lost(&self, n: usize) -> usize {
        (0..n)
            .map(id)
            .filter(|id| {
                !self.target.contains_key(id)
                    && !self.quarantine.contains_key(id)
                    && !self.dlq.contains(id)
                    && !self.duplicates.contains(id)
            })
            .count()
    }

    pub fn unknown(&self) -> usize {
        self.quarantine
            .values()
            .filter(|r| r.starts_with("OutcomeUnknown"))
            .count()
    }
}

pub fn id(i: usize) -> String {
    format!("f{i:05}")
}

/// Dead-letter `n` jobs with ids `f00000`….
pub async fn dead_letter_n(w: &World, n: usize) {
    w.dead_letter((0..n).map(|i| job(&id(i), json!({"n": i}))).collect())
        .await;
}

/// The invariants of DESIGN that hold for any finished replay: the counts add up, one audit
/// row per decided message, every message somewhere.
pub fn verify(status: &ReplayStatus, audit: &[store::AuditRow], problems: &mut Vec<String>) {
    let c = status.counts;
    if c.scanned != c.replayed + c.duplicates + c.quarantined + c.skipped + c.failed {
        problems.push(format!("counts do not add up: {c:?}"));
    }
    if audit.len() as u64 != c.scanned - c.skipped {
        problems.push(format!(
            "{} audit rows for scanned {} - skipped {}",
            audit.len(),
            c.scanned,
            c.skipped
        ));
    }
    if status.audit.as_ref().map(|a| a.records) != Some(audit.len() as u64) {
        problems.push(format!(
            "status.audit.records {:?} but {} rows",
            status.audit.as_ref().map(|a| a.records),
            audit.len()
        ));
    }
}

/// `n` distinct points in (5 %, 95 %) of `total`, sorted, from `seed`.
pub fn points(seed: u64, n: usize, total: usize) -> Vec<usize> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut set = BTreeSet::new();
    while set.len() < n {
        set.insert(rng.random_range(total / 20..total * 19 / 20));
    }
    set.into_iter().collect()
}

/// Wait until `queue` holds at least `count` messages (or `give_up` passed).
pub async fn until_depth(w: &World, queue: &str, count: usize, give_up: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < give_up {
        if w.depth(queue).await as usize >= count {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

/// The common ending: the phase must be Done, then find every message and check the invariants.
#[allow(clippy::too_many_arguments)]
async fn finish(
    w: &World,
    fault: &str,
    mode: &'static str,
    n: usize,
    runs: usize,
    status: &ReplayStatus,
    mut problems: Vec<String>,
    extra: impl FnOnce(&Places, &mut Vec<String>) -> String,
) -> Tally {
    finish_on(
        w,
        redis_url(),
        &w.topo.work.clone(),
        fault,
        mode,
        n,
        runs,
        status,
        &mut problems,
        extra,
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn finish_on(
    w: &World,
    redis_url: &str,
    target: &str,
    fault: &str,
    mode: &'static str,
    n: usize,
    runs: usize,
    status: &ReplayStatus,
    problems: &mut Vec<String>,
    extra: impl FnOnce(&Places, &mut Vec<String>) -> String,
) -> Tally {
    if status.phase != Some(Phase::Done) {
        problems.push(format!("phase {:?}: {:?}", status.phase, status.message));
    }
    let audit = match status.audit.as_ref() {
        Some(a) => {
            let mut r = store::connect(redis_url).await.expect("redis");
            store::read_audit(&mut r, &a.key).await.unwrap_or_default()
        }
        None => Vec::new(),
    };
    verify(status, &audit, problems);
    let places = Places::collect(w, target, &audit).await;
    let detail = extra(&places, problems);
    Tally {
        fault: fault.into(),
        runs,
        messages: n,
        lost: places.lost(n),
        twice: places.keys_twice,
        mode,
        detail,
        problems: std::mem::take(problems),
    }
}

/// The DLQ's total (ready + unacked) on the world's broker: it drops only on an ack.
///
/// Classic: `rabbitmqctl list_queues messages`, which asks the queue. Quorum: that column comes
/// from metrics the queue emits on a timer (RabbitMQ 4.x showed 0 for a quorum DLQ holding 600
/// messages, then caught up seconds later), so the total is counted instead: ready from a
/// passive declare (answered by the queue's leader) plus the unacked deliveries on this world's
/// replay channels (`rabbitmqctl list_channels`, asked of each channel; with the canary off the
/// replay consumes from the DLQ only).
async fn dlq_total(w: &World, queue: &str) -> Option<u64> {
    if w.target.is_quorum() {
        let ready = u64::from(fixture_depth(w, queue).await?);
        let conns = replay_connections(w);
        let out = w
            .target
            .broker
            .ctl(&[
                "list_channels",
                "-q",
                "--no-table-headers",
                "connection",
                "messages_unacknowledged",
            ])
            .output()
            .ok()?;
        let unacked: u64 = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let conn = f.next()?;
                conns
                    .iter()
                    .any(|c| c == conn)
                    .then(|| f.next()?.parse::<u64>().ok())?
            })
            .sum();
        return Some(ready + unacked);
    }
    let out = w
        .target
        .broker
        .ctl(&[
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages",
        ])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let mut f = l.split_whitespace();
        (f.next() == Some(queue)).then(|| f.next()?.parse().ok())?
    })
}

/// Ready messages of `queue` (a passive declare), `None` when it cannot be asked.
async fn fixture_depth(w: &World, queue: &str) -> Option<u32> {
    crate::fixture::depth(&w.ch, queue).await.ok()
}
