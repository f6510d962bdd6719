//! The canary: pre-flight checks, one message per failure signature, and watching for it to
//! come back before the rest is drained.
//!
//! Canaries are chosen in one traversal of the queue ([`Scan`]): only the canaries are taken
//! (acked after their publish is confirmed and audited); every other message is moved to the
//! tail, so the queue afterwards holds them in their old order and no delivery count grew. A
//! failed pre-flight puts the candidates back the same way and waits on the cheap checks alone
//! before looking at the queue again. Returns are watched on a queue of our own bound to the
//! dead-letter routes ([`Returns`]); where no route is known, an infrequent traversal of the
//! watched queues (that moves, never hands back) looks for them instead.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::Connection;
use redis::aio::ConnectionManager;

use crate::classify::{self, Destination, Rules, Verdict};
use crate::message;
use crate::now;
use crate::publish::{self, Publisher};
use crate::scan::Scan;
use crate::source;
use crate::spec::{DlqReplaySpec, IdempotencyMode};
use crate::status::{CanaryResult, CanaryStatus, Counts};
use crate::store::{AuditRow, ClaimEnd, Decision, Held, Store};
use crate::watch::{self, Returned, Returns};
use crate::Error;

/// Without a route to watch, the watched queues are traversed at most this often.
const SEARCH_EVERY: Duration = Duration::from_secs(10);

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
    Sent(Box<Watch>),
    /// Nothing to canary (no replayable message).
    Nothing,
    /// A pre-flight check failed (the reason), on these target queues; the queue is as it was.
    Pending(String, Vec<String>),
    /// The queue fails a check that waiting cannot fix (too much poison: the fix is probably not
    /// deployed; too many signatures); nothing was replayed.
    Refused(String),
}

/// Canaries in flight.
pub struct Watch {
    /// Per signature.
    pub canaries: Vec<CanaryStatus>,
    keys: Vec<Option<String>>,
    identities: Vec<String>,
    /// The watch queue on the dead-letter routes, when any is known.
    returns: Option<Returns>,
    /// Without one: what each watched queue held at the last look, and when it was searched.
    baselines: BTreeMap<String, u32>,
    last_search: Option<tokio::time::Instant>,
    deadline: tokio::time::Instant,
    /// Counts of the canary publishes.
    pub delta: Counts,
    /// Audit rows written.
    pub records: u64,
}

/// Where the canary phase works: the replay's connections, its Redis and its broker URL.
pub struct Ground<'a> {
    /// The source connection (reads, checks, the watch queue).
    pub conn: &'a Connection,
    /// The broker URL (names the per-queue ledger and routes).
    pub amqp_url: &'a str,
    /// The replay's Redis.
    pub redis: ConnectionManager,
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
    ground: &Ground<'_>,
    spec: &DlqReplaySpec,
    replay_id: &str,
    claim_value: &str,
    publisher: &mut Publisher,
    store: &mut Store,
    redis: &mut ConnectionManager,
) -> Result<Selection, Error> {
    let queue = &spec.source.queue;
    let mut scan = Scan::open(
        ground.conn,
        publisher.connection(),
        ground.redis.clone(),
        ground.amqp_url,
        queue,
    )
    .await?;
    let rules = Rules::of(spec, replay_id);
    let mut by_sig: BTreeMap<String, Candidate> = BTreeMap::new();
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let (mut scanned, mut poison) = (0u64, 0u64);
    // Once the selection cannot go on (too many signatures, a failed pre-flight), the rest of the
    // traversal keeps every message, so that a full pass leaves the queue in its old order.
    let mut refused: Option<String> = None;
    let mut pending: Option<String> = None;
    let mut checked: Vec<String> = Vec::new();
    while let Some(d) = scan.next().await? {
        if refused.is_some() {
            scan.keep(d).await?;
            continue;
        }
        scanned += 1;
        let (key, destination) = match classify::classify(&rules, &d.properties, &d.data) {
            Verdict::Replay { key, destination } => (key, destination),
            Verdict::Poison(_) => {
                poison += 1;
                scan.keep(d).await?;
                continue;
            }
            Verdict::Skip(_) => {
                scan.keep(d).await?;
                continue;
            }
        };
        let sig = classify::signature(&spec.canary.signature_header, &d.properties);
        *counts.entry(sig.clone()).or_default() += 1;
        if counts.len() > spec.canary.max_signatures as usize {
            refused = Some(too_many_signatures(spec, scanned));
            scan.keep(d).await?;
            continue;
        }
        if pending.is_some()
            || by_sig.contains_key(&sig)
            || is_done(spec, redis, key.as_deref()).await?
        {
            scan.keep(d).await?;
            continue;
        }
        // A new candidate: check the ground it would land on now, so that a failed check leaves
        // it in its place.
        if let Some(q) = landing_queue(spec, &d).filter(|q| !checked.contains(q)) {
            checked.push(q.clone());
            if let Some(why) = preflight(ground.conn, spec, &[q]).await? {
                pending = Some(why);
                scan.keep(d).await?;
                continue;
            }
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
    if let Some(why) = refused {
        put_back(scan, by_sig).await?;
        return Ok(Selection::Refused(why));
    }
    if let Some(max) = spec.poison.max_quarantine_ratio {
        if scanned > 0 && poison as f64 / scanned as f64 > max {
            put_back(scan, by_sig).await?;
            return Ok(Selection::Refused(format!(
                "{poison} of {scanned} messages are poison, more than poison.maxQuarantineRatio {max}: the fix is probably not deployed; nothing was replayed"
            )));
        }
    }
    if let Some(why) = pending {
        put_back(scan, by_sig).await?;
        return Ok(Selection::Pending(why, checked));
    }
    if by_sig.is_empty() {
        scan.finish().await?;
        return Ok(Selection::Nothing);
    }
    // Checked once more: the traversal took a while.
    if let Some(why) = preflight(ground.conn, spec, &checked).await? {
        put_back(scan, by_sig).await?;
        return Ok(Selection::Pending(why, checked));
    }
    let mut cands: Vec<Candidate> = by_sig.into_values().collect();
    for c in &mut cands {
        c.messages = counts.get(&c.signature).copied().unwrap_or(0);
    }
    // Everything else is back in the queue; watch before anything leaves, so that a canary
    // that comes back at once is seen.
    scan.flush().await?;
    let mut routes = watch::known(redis, ground.amqp_url, queue).await?;
    routes.extend(scan.routes().iter().cloned());
    let returns = Returns::open(ground.conn, &routes).await?;
    let baselines = match returns {
        Some(_) => BTreeMap::new(),
        None => {
            tracing::info!(queue = %queue, every_s = SEARCH_EVERY.as_secs(), "no dead-letter route known: canary returns are searched for by traversal");
            baselines(ground.conn, spec).await?
        }
    };
    let mut watch = publish_canaries(
        &mut scan,
        spec,
        replay_id,
        claim_value,
        publisher,
        store,
        cands,
    )
    .await?;
    scan.finish().await?;
    watch.returns = returns;
    watch.baselines = baselines;
    Ok(Selection::Sent(Box::new(watch)))
}

/// Move the held candidates back into the queue and end the traversal.
async fn put_back(mut scan: Scan, by_sig: BTreeMap<String, Candidate>) -> Result<(), Error> {
    for c in by_sig.into_values() {
        scan.keep(c.delivery).await?;
    }
    scan.finish().await
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
    // Not a canary candidate: done, or (Claim mode) held by anyone; the drain decides it.
    Ok(
        match (idem.mode, Held::of(v.as_deref(), &idem.done_value)) {
            (_, Held::Done) => true,
            (IdempotencyMode::Check, _) | (_, Held::Free) => false,
            (IdempotencyMode::Claim, _) => true,
        },
    )
}

/// The queue a candidate would land on; none when the target exchange is overridden (the
/// landing queue is then the broker's business, not ours).
fn landing_queue(spec: &DlqReplaySpec, d: &Delivery) -> Option<String> {
    if spec.target.exchange.is_some() {
        return None;
    }
    classify::original_queue(&d.properties)
}

/// The ground a canary lands on: each target queue exists, has a consumer, and a small
/// backlog. Returns the first failed check.
pub async fn preflight(
    conn: &Connection,
    spec: &DlqReplaySpec,
    queues: &[String],
) -> Result<Option<String>, Error> {
    for q in queues {
        match source::queue_state(conn, q).await? {
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
    scan: &mut Scan,
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
        returns: None,
        baselines: BTreeMap::new(),
        last_search: None,
        deadline: tokio::time::Instant::now() + wait,
        delta: Counts::default(),
        records: 0,
    };
    let (mut rows, mut settled, mut acks, mut stays, mut claims) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
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
                // Claimed by someone else meanwhile: not a canary after all; it stays.
                scan.keep(c.delivery).await?;
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
            Ok(()) => Decision::Replayed,
            Err(_) => Decision::Failed,
        };
        if let (Some(_), Some(k)) = (claiming, &c.key) {
            // Like the drain's: a confirmed publish marks the claim published, a failed one
            // hands it back, so no later replay drops this message on its account.
            claims.push(ClaimEnd {
                key: k.clone(),
                value: claim_value.to_string(),
                published: res.is_ok(),
            });
        }
        if let Err(why) = &res {
            // Could not even be sent: this signature is held back, the message stays.
            status.result = CanaryResult::DiedAgain;
            status.reason = Some(format!("canary could not be published: {why}"));
            watch.delta.failed += 1;
        } else {
            watch.delta.replayed += 1;
            settled.push((
                message::fingerprint(props, &c.delivery.data),
                Decision::Replayed.as_str().to_string(),
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
            decision: decision.as_str().into(),
            key: c.key.clone().unwrap_or_default(),
            reason: res.err().unwrap_or_default(),
            destination: format!("{}/{}", c.destination.exchange, c.destination.routing_key),
            canary: true,
            time: now(),
            signature: c.signature.clone(),
            ..Default::default()
        });
        let failed = status.result == CanaryResult::DiedAgain;
        watch.canaries.push(status);
        watch.keys.push(c.key);
        watch.identities.push(identity);
        if failed {
            stays.push(c.delivery);
        }
    }
    watch.records = store
        .commit(&rows, &settled, &claims, &watch.delta)
        .await?
        .0;
    for tag in acks {
        scan.ack(tag).await?;
    }
    for d in stays {
        scan.keep(d).await?;
    }
    Ok(watch)
}

/// What each watched queue holds now, with the canaries not yet out and everything else back in
/// the queue: a queue that grows past it may hold a returned canary.
async fn baselines(
    conn: &Connection,
    spec: &DlqReplaySpec,
) -> Result<BTreeMap<String, u32>, Error> {
    let mut out = BTreeMap::new();
    for q in std::iter::once(&spec.source.queue).chain(&spec.canary.watch_queues) {
        let now = source::queue_state(conn, q).await?.map_or(0, |s| s.0);
        out.insert(q.clone(), now);
    }
    Ok(out)
}

impl Watch {
    /// Whether every canary has a result.
    pub fn settled(&self) -> bool {
        self.canaries
            .iter()
            .all(|c| c.result != CanaryResult::Waiting)
    }

    /// One look: new dead letters on the watched routes (or, without a route, queues that grew
    /// and were not searched lately) are checked for returned canaries; with Check mode, keys
    /// marked done confirm their canary. Returns true when the wait is over.
    pub async fn look(
        &mut self,
        ground: &Ground<'_>,
        publish: &Connection,
        spec: &DlqReplaySpec,
        replay_id: &str,
        redis: &mut ConnectionManager,
    ) -> Result<bool, Error> {
        if let Some(r) = &self.returns {
            let found = r.poll(replay_id, &spec.canary.signature_header).await?;
            self.mark(found);
        } else {
            self.search(ground, publish, spec, replay_id).await?;
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
        if over || self.settled() {
            if let Some(r) = self.returns.take() {
                r.close().await;
            }
            return Ok(true);
        }
        Ok(false)
    }

    fn mark(&mut self, found: Vec<Returned>) {
        for r in found {
            if let Some(i) = self.identities.iter().position(|x| *x == r.identity) {
                self.canaries[i].result = CanaryResult::DiedAgain;
                self.canaries[i].reason = Some(r.reason);
            }
        }
    }

    /// Without a route to watch: traverse each watched queue that grew, at most every
    /// [`SEARCH_EVERY`], moving what it holds (never handing it back).
    async fn search(
        &mut self,
        ground: &Ground<'_>,
        publish: &Connection,
        spec: &DlqReplaySpec,
        replay_id: &str,
    ) -> Result<(), Error> {
        if self.last_search.is_some_and(|t| t.elapsed() < SEARCH_EVERY) {
            return Ok(());
        }
        let queues: Vec<(String, u32)> = self
            .baselines
            .iter()
            .map(|(q, n)| (q.clone(), *n))
            .collect();
        for (q, base) in queues {
            let now = source::queue_state(ground.conn, &q)
                .await?
                .map_or(0, |s| s.0);
            if now <= base {
                continue;
            }
            self.last_search = Some(tokio::time::Instant::now());
            let mut scan = Scan::open(
                ground.conn,
                publish,
                ground.redis.clone(),
                ground.amqp_url,
                &q,
            )
            .await?;
            let mut found = Vec::new();
            while let Some(d) = scan.next().await? {
                if let Some(r) = watch::returned(&d, replay_id, &spec.canary.signature_header) {
                    found.push(r);
                }
                scan.keep(d).await?;
            }
            scan.finish().await?;
            self.mark(found);
            self.baselines.insert(q, now);
        }
        Ok(())
    }
}
