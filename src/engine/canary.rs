//! The canary: pre-flight checks, one message per failure signature, and watching for it to
//! come back before the rest is drained.
//!
//! Canaries are chosen with `basic.get` on a channel of their own: only the canaries are acked
//! (after their publish is confirmed and audited); closing the channel hands every other message
//! back to the queue in its place. Watching for returns looks at the queue only when its depth
//! grew past what it held when the canaries left, and looks without taking anything.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::Connection;
use redis::aio::ConnectionManager;

use crate::api::{CanaryResult, CanaryStatus, Counts, DlqReplaySpec, IdempotencyMode};
use crate::engine::classify::{self, Destination, Rules, Verdict};
use crate::engine::message::{self, REPLAY_ID};
use crate::engine::now;
use crate::engine::publish::{self, Publisher};
use crate::engine::source;
use crate::engine::store::{AuditRow, Store};
use crate::Error;

/// One signature's canary candidate, chosen from the queue.
struct Candidate {
    signature: String,
    delivery: Delivery,
    destination: Destination,
    key: Option<String>,
    messages: u64,
}

/// What the selection pass found.
pub enum Selection {
    /// Canaries are out: watch them.
    Sent(Watch),
    /// Nothing to canary (no replayable message).
    Nothing,
    /// A pre-flight check failed; nothing was touched.
    Pending(String),
    /// The queue fails a check that waiting cannot fix (too much poison: the fix is probably not
    /// deployed; too many signatures); nothing was touched.
    Refused(String),
}

/// Canaries in flight.
pub struct Watch {
    /// Per signature.
    pub canaries: Vec<CanaryStatus>,
    keys: Vec<Option<String>>,
    identities: Vec<String>,
    baselines: BTreeMap<String, u32>,
    deadline: tokio::time::Instant,
    /// Counts of the canary publishes.
    pub delta: Counts,
    /// Audit rows written.
    pub records: u64,
}

fn too_many_signatures(spec: &DlqReplaySpec, scanned: u64) -> String {
    let c = &spec.canary;
    format!(
        "TooManySignatures: the first {scanned} messages already hold more than canary.maxSignatures {} distinct failure signatures (values of header {:?}, else death reason and queue): one canary each would prove nothing; set canary.signatureHeader to a header with fewer values or raise canary.maxSignatures; nothing was replayed",
        c.max_signatures, c.signature_header
    )
}

/// Choose one canary per signature, check the ground, publish them. `replay_id` tags them.
#[allow(clippy::too_many_arguments)]
pub async fn send(
    conn: &Connection,
    spec: &DlqReplaySpec,
    replay_id: &str,
    claim_value: &str,
    publisher: &mut Publisher,
    store: &mut Store,
    redis: &mut ConnectionManager,
) -> Result<Selection, Error> {
    let queue = &spec.source.queue;
    let depth = source::queue_state(conn, queue)
        .await?
        .ok_or_else(|| Error::SourceMissing(queue.clone()))?
        .0;
    let ch = conn.create_channel().await?;
    let rules = Rules::of(spec, replay_id);
    let mut by_sig: BTreeMap<String, Candidate> = BTreeMap::new();
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let (mut scanned, mut poison) = (0u64, 0u64);
    for _ in 0..depth {
        let Some(m) = ch
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        let d = m.delivery;
        scanned += 1;
        let (key, destination) = match classify::classify(&rules, &d.properties, &d.data) {
            Verdict::Replay { key, destination } => (key, destination),
            Verdict::Poison(_) => {
                poison += 1;
                continue;
            }
            Verdict::Skip(_) => continue,
        };
        let sig = classify::signature(&spec.canary.signature_header, &d.properties);
        *counts.entry(sig.clone()).or_default() += 1;
        if counts.len() > spec.canary.max_signatures as usize {
            let _ = ch.close(200, "too many signatures".into()).await;
            return Ok(Selection::Refused(too_many_signatures(spec, scanned)));
        }
        if by_sig.contains_key(&sig) || is_done(spec, redis, key.as_deref()).await? {
            continue;
        }
        by_sig.insert(
            sig.clone(),
            Candidate {
                signature: sig,
                delivery: d,
                destination,
                key,
                messages: 0,
            },
        );
    }
    if let Some(max) = spec.poison.max_quarantine_ratio {
        if scanned > 0 && poison as f64 / scanned as f64 > max {
            let _ = ch.close(200, "too much poison".into()).await;
            return Ok(Selection::Refused(format!(
                "{poison} of {scanned} messages are poison, more than poison.maxQuarantineRatio {max}: the fix is probably not deployed; nothing was replayed"
            )));
        }
    }
    if by_sig.is_empty() {
        let _ = ch.close(200, "no canary".into()).await;
        return Ok(Selection::Nothing);
    }
    if let Some(reason) = preflight(conn, spec, by_sig.values()).await? {
        let _ = ch.close(200, "pending".into()).await;
        return Ok(Selection::Pending(reason));
    }
    let mut cands: Vec<Candidate> = by_sig.into_values().collect();
    for c in &mut cands {
        c.messages = counts.get(&c.signature).copied().unwrap_or(0);
    }
    let watch =
        publish_canaries(&ch, spec, replay_id, claim_value, publisher, store, cands).await?;
    // Everything but the canaries goes back in place.
    ch.close(200, "canaries out".into()).await?;
    let mut watch = watch;
    watch.baselines = baselines(conn, spec, depth, &watch).await?;
    Ok(Selection::Sent(watch))
}

async fn is_done(
    spec: &DlqReplaySpec,
    redis: &mut ConnectionManager,
    key: Option<&str>,
) -> Result<bool, Error> {
    let (Some(idem), Some(key)) = (&spec.idempotency, key) else {
        return Ok(false);
    };
    let v: Option<String> = redis::cmd("GET").arg(key).query_async(redis).await?;
    Ok(match idem.mode {
        IdempotencyMode::Check => v.as_deref() == Some(idem.done_value.as_str()),
        IdempotencyMode::Claim => v.is_some(),
    })
}

/// The ground a canary lands on: the target's queue exists, has a consumer, and a small
/// backlog. Returns the first failed check.
async fn preflight<'a>(
    conn: &Connection,
    spec: &DlqReplaySpec,
    cands: impl Iterator<Item = &'a Candidate>,
) -> Result<Option<String>, Error> {
    let mut queues: Vec<String> = Vec::new();
    for c in cands {
        // With an overridden exchange the landing queue is the broker's business, not ours.
        if spec.target.exchange.is_some() {
            continue;
        }
        if let Some(q) = classify::original_queue(&c.delivery.properties) {
            if !queues.contains(&q) {
                queues.push(q);
            }
        }
    }
    for q in queues {
        match source::queue_state(conn, &q).await? {
            None => {
                return Ok(Some(format!(
                    "TargetQueueMissing: target queue {q:?} does not exist"
                )))
            }
            Some((_, 0)) if spec.canary.require_consumer => {
                return Ok(Some(format!(
                    "NoConsumer: no consumer is attached to target queue {q:?}"
                )))
            }
            Some((n, _)) if u64::from(n) > spec.canary.max_backlog => {
                return Ok(Some(format!(
                "Backlog: target queue {q:?} holds {n} messages, more than canary.maxBacklog {}",
                spec.canary.max_backlog
            )))
            }
            Some(_) => {}
        }
    }
    Ok(None)
}

#[allow(clippy::too_many_arguments)]
async fn publish_canaries(
    ch: &lapin::Channel,
    spec: &DlqReplaySpec,
    replay_id: &str,
    claim_value: &str,
    publisher: &mut Publisher,
    store: &mut Store,
    cands: Vec<Candidate>,
) -> Result<Watch, Error> {
    publisher.ensure_open().await?;
    let claiming = spec
        .idempotency
        .as_ref()
        .filter(|i| i.mode == IdempotencyMode::Claim);
    let wait = Duration::from_secs(spec.canary.wait_seconds);
    let sent_at = now();
    let wait_until = (chrono::Utc::now()
        + chrono::Duration::seconds(spec.canary.wait_seconds as i64))
    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let mut watch = Watch {
        canaries: Vec::new(),
        keys: Vec::new(),
        identities: Vec::new(),
        baselines: BTreeMap::new(),
        deadline: tokio::time::Instant::now() + wait,
        delta: Counts::default(),
        records: 0,
    };
    let (mut rows, mut settled, mut acks) = (Vec::new(), Vec::new(), Vec::new());
    for c in cands {
        let props = &c.delivery.properties;
        let identity = message::identity(props, &c.delivery.data);
        if let (Some(idem), Some(k)) = (claiming, &c.key) {
            let fields = [(message::fingerprint(props, &c.delivery.data), None::<&str>)];
            let f: Vec<(&str, Option<&str>)> =
                fields.iter().map(|(a, b)| (a.as_str(), *b)).collect();
            let l = store
                .lookup(
                    &f,
                    &[Some(k.as_str())],
                    Some((claim_value, idem.ttl_seconds)),
                )
                .await?;
            if !l.first().is_some_and(|l| l.claimed) {
                continue;
            }
        }
        let p = publish::replay_properties(props, replay_id, c.key.as_deref(), publisher.user());
        let res = match publisher.send(&c.destination, p, &c.delivery.data).await {
            Ok(confirm) => publish::outcome(confirm.await),
            Err(e) => Err(format!("PublishError: {e}")),
        };
        let mut status = CanaryStatus {
            signature: c.signature.clone(),
            message_id: identity.clone(),
            sent_at: Some(sent_at.clone()),
            wait_until: Some(wait_until.clone()),
            result: CanaryResult::Waiting,
            reason: None,
            messages: c.messages,
        };
        let decision = match &res {
            Ok(()) => "replayed",
            Err(_) => "failed",
        };
        if let Err(why) = &res {
            // Could not even be sent: this signature is held back, the message stays.
            status.result = CanaryResult::DiedAgain;
            status.reason = Some(format!("canary could not be published: {why}"));
            watch.delta.failed += 1;
        } else {
            watch.delta.replayed += 1;
            settled.push((
                message::fingerprint(props, &c.delivery.data),
                "replayed".to_string(),
            ));
            if let Some(k) = &c.key {
                settled.push((format!("key:{k}"), identity.clone()));
            }
            acks.push(c.delivery.delivery_tag);
        }
        watch.delta.scanned += 1;
        rows.push(AuditRow {
            replay: replay_id.into(),
            message: identity.clone(),
            decision: decision.into(),
            key: c.key.clone().unwrap_or_default(),
            reason: res.err().unwrap_or_default(),
            destination: format!("{}/{}", c.destination.exchange, c.destination.routing_key),
            canary: true,
            time: now(),
            ..Default::default()
        });
        watch.canaries.push(status);
        watch.keys.push(c.key);
        watch.identities.push(identity);
    }
    watch.records = store.commit(&rows, &settled, &[], &watch.delta).await?.0;
    for tag in acks {
        ch.basic_ack(tag, BasicAckOptions::default()).await?;
    }
    Ok(watch)
}

/// What each watched queue holds once the canaries left: the source's depth before, minus the
/// canaries taken from it, so a canary that came back before the first look still counts.
async fn baselines(
    conn: &Connection,
    spec: &DlqReplaySpec,
    depth: u32,
    w: &Watch,
) -> Result<BTreeMap<String, u32>, Error> {
    let sent = w
        .canaries
        .iter()
        .filter(|c| c.result == CanaryResult::Waiting)
        .count() as u32;
    let mut out = BTreeMap::new();
    out.insert(spec.source.queue.clone(), depth.saturating_sub(sent));
    for q in &spec.canary.watch_queues {
        let now = source::queue_state(conn, q).await?.map_or(0, |s| s.0);
        out.insert(q.clone(), now);
    }
    Ok(out)
}

/// A message this replay published that came back with a fresh death.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Returned {
    /// Its identity (message id or body hash).
    pub identity: String,
    /// Its fingerprint (message id and body).
    pub fingerprint: String,
    /// The new death, e.g. `died again: rejected in media.work, x-exception-type=KeyError`.
    pub reason: String,
}

/// Look through a queue without taking anything (every message goes back in place when the
/// channel closes) for messages of this replay carrying a death. Returns the queue's length and
/// what came back.
pub async fn find_returns(
    conn: &Connection,
    queue: &str,
    replay_id: &str,
    sig_header: &str,
) -> Result<(u32, Vec<Returned>), Error> {
    let ch = conn.create_channel().await?;
    let mut n = 0u32;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await?
    {
        n += 1;
        let p = &m.delivery.properties;
        if message::header_text(p, REPLAY_ID).as_deref() != Some(replay_id) {
            continue;
        }
        let Some(death) = message::deaths(p).into_iter().next() else {
            continue;
        };
        let mut reason = format!("died again: {} in {}", death.reason, death.queue);
        if let Some(v) = message::header_text(p, sig_header) {
            reason.push_str(&format!(", {sig_header}={v}"));
        }
        out.push(Returned {
            identity: message::identity(p, &m.delivery.data),
            fingerprint: message::fingerprint(p, &m.delivery.data),
            reason,
        });
    }
    ch.close(200, "looked".into()).await?;
    Ok((n, out))
}

impl Watch {
    /// Whether every canary has a result.
    pub fn settled(&self) -> bool {
        self.canaries
            .iter()
            .all(|c| c.result != CanaryResult::Waiting)
    }

    /// One look: queues that grew are searched for returned canaries; with Check mode, keys
    /// marked done confirm their canary. Returns true when the wait is over.
    pub async fn look(
        &mut self,
        conn: &Connection,
        spec: &DlqReplaySpec,
        replay_id: &str,
        redis: &mut ConnectionManager,
    ) -> Result<bool, Error> {
        let queues: Vec<(String, u32)> = self
            .baselines
            .iter()
            .map(|(q, n)| (q.clone(), *n))
            .collect();
        for (q, base) in queues {
            let now = source::queue_state(conn, &q).await?.map_or(0, |s| s.0);
            if now > base {
                self.search(conn, &q, replay_id, &spec.canary.signature_header)
                    .await?;
            }
        }
        if let Some(idem) = spec
            .idempotency
            .as_ref()
            .filter(|i| i.mode == IdempotencyMode::Check)
        {
            for (i, key) in self.keys.iter().enumerate() {
                let Some(k) = key else { continue };
                if self.canaries[i].result != CanaryResult::Waiting {
                    continue;
                }
                let v: Option<String> = redis::cmd("GET").arg(k).query_async(redis).await?;
                if v.as_deref() == Some(idem.done_value.as_str()) {
                    self.canaries[i].result = CanaryResult::Confirmed;
                }
            }
        }
        let over = tokio::time::Instant::now() >= self.deadline;
        if over {
            for c in &mut self.canaries {
                if c.result == CanaryResult::Waiting {
                    if spec.canary.require_done {
                        c.result = CanaryResult::Unconfirmed;
                        c.reason = Some(
                            "the worker did not mark the key done within canary.waitSeconds".into(),
                        );
                    } else {
                        c.result = CanaryResult::Passed;
                    }
                }
            }
        }
        Ok(over || self.settled())
    }

    /// Look through a queue without taking anything, for canaries carrying a fresh death.
    async fn search(
        &mut self,
        conn: &Connection,
        queue: &str,
        replay_id: &str,
        sig_header: &str,
    ) -> Result<(), Error> {
        let (n, returns) = find_returns(conn, queue, replay_id, sig_header).await?;
        for r in returns {
            if let Some(i) = self.identities.iter().position(|x| *x == r.identity) {
                self.canaries[i].result = CanaryResult::DiedAgain;
                self.canaries[i].reason = Some(r.reason);
            }
        }
        self.baselines.insert(queue.to_string(), n);
        Ok(())
    }

    /// Signatures whose canary did not pass: their messages stay in the queue.
    pub fn held_back(&self) -> HashSet<String> {
        self.canaries
            .iter()
            .filter(|c| {
                matches!(
                    c.result,
                    CanaryResult::DiedAgain | CanaryResult::Unconfirmed
                )
            })
            .map(|c| c.signature.clone())
            .collect()
    }
}
