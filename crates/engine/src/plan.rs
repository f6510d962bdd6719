//! The dry run: classify every message the replay would see, change nothing anyone can see.
//!
//! One traversal ([`Scan`]) reads each message and moves it to the tail: afterwards the queue
//! holds the same messages, in the same order, with the same bytes, and (unlike handing them
//! back) no quorum-queue delivery count grew, so a plan can be run any number of times. The
//! idempotency keys are only read; the one write is the per-queue move ledger.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;
use sha2::Digest as _;

use crate::classify::{self, Rules, SkipReason, Verdict};
use crate::message;
use crate::scan::Scan;
use crate::spec::{ExpectSpec, IdempotencyMode, Published};
use crate::status::{CanaryResult, CanaryStatus, Counts, Phase, ReplayStatus};
use crate::store::Held;
use crate::Error;
use crate::{connect_amqp, now, store, Replay};

/// What a replay would do.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PlanReport {
    /// Messages in the queue when the plan looked.
    pub depth: u64,
    /// Would-be decisions (`replayed` = would be replayed).
    pub counts: Counts,
    /// Would-be decisions per failure signature.
    pub by_signature: BTreeMap<String, Counts>,
    /// How many messages each quarantine or skip reason covers.
    pub reasons: BTreeMap<String, u64>,
    /// With the canary on: each signature that would get a canary, and the message (id, else
    /// body hash) that would be it: the first of the signature that would be replayed. A
    /// signature an earlier run of this replay decided gets none.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub canaries: BTreeMap<String, String>,
    /// The pre-flight on the replay's Redis for what the replay would decide (`None`: Redis
    /// would not say, see `redisError`).
    pub redis: Option<crate::RedisCheck>,
    /// Why the Redis pre-flight could not be made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_error: Option<String>,
    /// The `spec.expect` stanza that approves exactly what this plan would do: the signatures
    /// with messages to replay, and the counts as maximums. `None` when nothing would be
    /// replayed (an empty list of signatures would approve them all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expect: Option<ExpectSpec>,
    /// The `spec.expect` maximum the replay would reach (it stops there), when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exceeds: Option<String>,
    /// What an approval names (`sha256:` and 32 hex digits): a hash of every message the plan
    /// read (message id and body, in queue order) and of the decisions it counted. Any message
    /// added, removed or changed, or a decision that changed (a key marked done since), gives
    /// another digest.
    pub digest: String,
}

/// The `spec.expect` an approved plan amounts to: the signatures it would replay and its counts
/// as maximums. A plan that replays nothing approves no replay (a maximum of 0), never every
/// signature.
pub fn approved(counts: &Counts, by_signature: &BTreeMap<String, Counts>) -> ExpectSpec {
    let signatures: Vec<String> = by_signature
        .iter()
        .filter(|(_, c)| c.replayed > 0)
        .map(|(s, _)| s.clone())
        .collect();
    ExpectSpec {
        max_replayed: Some(if signatures.is_empty() {
            0
        } else {
            counts.replayed
        }),
        signatures,
        max_quarantined: Some(counts.quarantined),
    }
}

/// The `spec.expect` a replay runs under once `approved` (an approved plan's, see [`approved`])
/// binds it: its own `expect` narrowed to the plan, else the plan's.
pub fn bound(expect: Option<&ExpectSpec>, approved: ExpectSpec) -> ExpectSpec {
    match expect {
        Some(e) => e.narrowed(&approved),
        None => approved,
    }
}

impl PlanReport {
    /// The stanza of [`PlanReport::expect`], from the counts.
    fn expectation(&self) -> Option<ExpectSpec> {
        let e = approved(&self.counts, &self.by_signature);
        (!e.signatures.is_empty()).then_some(e)
    }

    /// The digest of the messages read (`read`: their fingerprints hashed in order) and of the
    /// decisions counted.
    fn sealed(&self, read: sha2::Sha256) -> String {
        let mut h = read;
        h.update(serde_json::to_vec(&(&self.counts, &self.by_signature)).unwrap_or_default());
        crate::message::short_hex("sha256:", &h.finalize())
    }

    /// Which of `expect`'s maximums these counts go past: where the replay would stop.
    fn exceeded(&self, expect: &ExpectSpec) -> Option<String> {
        let c = &self.counts;
        [
            (Published::Replayed, c.replayed),
            (Published::Quarantined, c.quarantined),
        ]
        .into_iter()
        .find_map(|(what, n)| {
            n.checked_sub(1)
                .and_then(|before| expect.exceeded(what, before))
        })
    }

    /// The status `run` reports for `dryRun: true`.
    pub fn status(&self) -> ReplayStatus {
        let c = self.counts;
        ReplayStatus {
            phase: Some(Phase::Done),
            source_depth_at_start: Some(self.depth),
            counts: c,
            started_at: Some(now()),
            finished_at: Some(now()),
            message: Some(format!("dry run, nothing changed: {}", c.would())),
            ..Default::default()
        }
    }
}

/// Classify every message of the source queue without changing anything.
pub async fn plan(replay: &Replay) -> Result<PlanReport, Error> {
    let conn = connect_amqp(&replay.amqp_url, &replay.connection_name("plan")).await?;
    let queue = &replay.spec.source.queue;
    let redis = store::connect(&replay.redis_url).await?;
    let mut con = replay.spec.idempotency.as_ref().map(|_| redis.clone());
    // An existing replay of this name: recognise its own returned messages as it would.
    let state = match con.clone() {
        Some(c) => store::Store::peek(c, &replay.namespace, &replay.state_name()).await?,
        None => None,
    };
    let mut canaries = Canaries::of(replay, state.as_ref());
    let replay_id = state.map(|s| s.replay_id).unwrap_or_default();
    let rules = Rules::of(&replay.spec, &replay_id);
    let mut redis_con = redis.clone();
    let mut scan = Scan::open(&conn, &conn, redis, &replay.amqp_url, queue).await?;
    let mut report = PlanReport {
        depth: scan.depth(),
        ..Default::default()
    };
    let mut selected = 0u64;
    let expect = replay.spec.expect.as_ref();
    let mut read = sha2::Sha256::new();
    // Keys to look up: the key, the signature, and the message's identity when it may be its
    // signature's canary.
    let mut pending: Vec<(String, String, Option<String>)> = Vec::new();
    loop {
        // The keys to look up go in batches of 256, and the last batch when the queue ends.
        let next = scan.next().await?;
        let end = next.is_none();
        if end || pending.len() >= 256 {
            resolve(
                replay,
                con.as_mut(),
                &mut pending,
                &mut report,
                &mut canaries,
            )
            .await?;
        }
        let Some(msg) = next else { break };
        let d = &msg;
        read.update(message::fingerprint(&d.properties, &d.data).as_bytes());
        let sig = classify::signature(&replay.spec.canary.signature_header, &d.properties);
        let limited = replay.spec.selector.limit.is_some_and(|l| selected >= l);
        let verdict = if limited {
            Verdict::Skip(SkipReason::NotSelected("selector.limit reached".into()))
        } else {
            classify::classify(&rules, &d.properties, &d.data)
        };
        // As the drain decides it: a signature spec.expect does not approve is held back.
        let verdict = match verdict {
            Verdict::Replay { .. } if expect.is_some_and(|e| !e.approves(&sig)) => {
                Verdict::Skip(SkipReason::NotSelected(
                    "NotApproved: signature not in spec.expect.signatures".into(),
                ))
            }
            v => v,
        };
        let by_sig = report.by_signature.entry(sig.clone()).or_default();
        report.counts.scanned += 1;
        by_sig.scanned += 1;
        match verdict {
            Verdict::Skip(reason) => {
                let why = match reason {
                    SkipReason::Returned => "returned by this replay".to_string(),
                    SkipReason::NotSelected(r) => r,
                };
                bump(&mut report, &sig, |c| c.skipped += 1);
                *report.reasons.entry(format!("skip: {why}")).or_default() += 1;
                scan.keep(msg).await?;
                continue;
            }
            Verdict::Poison(r) => {
                selected += 1;
                bump(&mut report, &sig, |c| c.quarantined += 1);
                let kind = r.split(':').next().unwrap_or(&r).to_string();
                *report
                    .reasons
                    .entry(format!("quarantine: {kind}"))
                    .or_default() += 1;
            }
            Verdict::Replay { key: Some(k), .. } if con.is_some() => {
                selected += 1;
                let id = canaries
                    .wants(&sig)
                    .then(|| message::identity(&d.properties, &d.data));
                pending.push((k, sig, id));
            }
            Verdict::Replay { .. } => {
                selected += 1;
                bump(&mut report, &sig, |c| c.replayed += 1);
                if canaries.wants(&sig) {
                    canaries.take(&mut report, &sig, message::identity(&d.properties, &d.data));
                }
            }
        }
        scan.keep(msg).await?;
    }
    scan.finish().await?;
    report.expect = report.expectation();
    report.digest = report.sealed(read);
    report.exceeds = expect.and_then(|e| report.exceeded(e));
    // What `run` would refuse, said to the reviewer before it is applied.
    let decided = report.counts.scanned - report.counts.skipped;
    match crate::redis_check(&replay.spec, &mut redis_con, decided).await {
        Ok(check) => report.redis = Some(check),
        Err(e) => report.redis_error = Some(e.to_string()),
    }
    let _ = conn.close(200, "plan done").await;
    Ok(report)
}

/// Which signatures would get a canary: those not decided by an earlier run, once each.
struct Canaries {
    on: bool,
    decided: HashSet<String>,
}

impl Canaries {
    fn of(replay: &Replay, state: Option<&store::State>) -> Self {
        let decided = state
            .and_then(|s| s.canary.as_deref())
            .and_then(|j| serde_json::from_str::<Vec<CanaryStatus>>(j).ok())
            .unwrap_or_default()
            .into_iter()
            .filter(|c| c.result != CanaryResult::Waiting)
            .map(|c| c.signature)
            .collect();
        Self {
            on: replay.spec.canary.enabled,
            decided,
        }
    }

    /// Whether a message of `sig` that would be replayed may still be its canary.
    fn wants(&self, sig: &str) -> bool {
        self.on && !self.decided.contains(sig)
    }

    /// The first message of `sig` that would be replayed is its canary.
    fn take(&mut self, report: &mut PlanReport, sig: &str, identity: String) {
        report.canaries.insert(sig.to_string(), identity);
        self.decided.insert(sig.to_string());
    }
}

fn bump(report: &mut PlanReport, sig: &str, f: impl Fn(&mut Counts)) {
    f(&mut report.counts);
    f(report.by_signature.entry(sig.to_string()).or_default());
}

/// Look the pending keys up (read only): done, or claimed by anyone, means duplicate.
async fn resolve(
    replay: &Replay,
    con: Option<&mut crate::store::Redis>,
    pending: &mut Vec<(String, String, Option<String>)>,
    report: &mut PlanReport,
    canaries: &mut Canaries,
) -> Result<(), Error> {
    let (Some(con), Some(idem)) = (con, replay.spec.idempotency.as_ref()) else {
        return Ok(());
    };
    if pending.is_empty() {
        return Ok(());
    }
    let keys: Vec<&str> = pending.iter().map(|(k, _, _)| k.as_str()).collect();
    let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(con).await?;
    for ((_, sig, id), v) in pending.drain(..).zip(values) {
        let sig = &sig;
        match (idem.mode, Held::of(v.as_deref(), &idem.done_value)) {
            (_, Held::Done) => bump(report, sig, |c| c.duplicates += 1),
            (IdempotencyMode::Claim, Held::Unconfirmed(_)) => {
                bump(report, sig, |c| c.quarantined += 1);
                *report
                    .reasons
                    .entry("quarantine: OutcomeUnknown".into())
                    .or_default() += 1;
            }
            (IdempotencyMode::Claim, Held::Published(_) | Held::Other(_)) => {
                bump(report, sig, |c| c.duplicates += 1)
            }
            _ => {
                bump(report, sig, |c| c.replayed += 1);
                if let Some(id) = id.filter(|_| canaries.wants(sig)) {
                    canaries.take(report, sig, id);
                }
            }
        }
    }
    Ok(())
}
