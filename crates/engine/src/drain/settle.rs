//! Landing a step: kept messages moved to the tail, then the step's outcome recorded in one
//! Redis commit, then the acks.

use super::{Act, Drain, Item};
use crate::keep;
use crate::status::Counts;
use crate::store::{self, AuditRow, Decision, Store};
use crate::Error;
use crate::{add, now};

/// A step's outcome as one commit writes it, and the acks that follow it.
pub(super) struct Record {
    rows: Vec<AuditRow>,
    settled: Vec<(String, String)>,
    claims: Vec<store::ClaimEnd>,
    delta: Counts,
    /// Delivery tags to ack, in order.
    acks: Vec<u64>,
    /// Every delivery tag of the step: those not acked now are held ([`Source::ack`]).
    tags: Vec<u64>,
    unknown: u32,
    unknown_why: String,
}

impl Record {
    /// Write it (see [`Store::commit`]): the audit stream's length after, and the keys marked
    /// twice.
    pub(super) async fn commit(&self, store: &mut Store) -> Result<(u64, u64), Error> {
        store
            .commit(&self.rows, &self.settled, &self.claims, &self.delta)
            .await
    }
}

/// Leave what a landing step does not take (skipped, held back, failed) in the queue: moved to
/// the tail, behind the pass's bound (see [`keep`]), in step order, so the queue keeps its
/// order. Returns each moved item's index, digest and copy on its way; the originals are
/// acked once their copies are confirmed ([`Drain::pend`]). It needs nothing the step's commit
/// writes, so a landing runs it beside the commit ([`Drain::settle_and_admit`]).
pub(super) async fn keep_moves(
    keeper: Option<&mut (keep::Mover, keep::Ledger)>,
    items: &[Item],
) -> Result<Vec<(usize, String, keep::Copy)>, Error> {
    // A step with an unconfirmed publish ends the pass: its messages go back to the queue
    // when the channel closes, and the next pass decides them again.
    if items.iter().any(|it| matches!(it.act, Act::Unknown(_))) {
        return Ok(Vec::new());
    }
    let Some((mover, ledger)) = keeper else {
        return Ok(Vec::new());
    };
    let idx: Vec<usize> = (0..items.len())
        .filter(|&i| matches!(items[i].act, Act::Skip { .. } | Act::Failed(_)))
        .collect();
    if idx.is_empty() {
        return Ok(Vec::new());
    }
    let digests: Vec<String> = idx
        .iter()
        .map(|&i| {
            let it = &items[i];
            it.digest
                .clone()
                .unwrap_or_else(|| keep::digest(&it.delivery.properties, &it.delivery.data))
        })
        .collect();
    // Counted before the copy exists: a crash in between leaves a count and no copy, never a
    // copy nobody counted (see keep::Ledger).
    ledger.intend(&digests).await?;
    let msgs: Vec<_> = idx
        .iter()
        .map(|&i| {
            (
                &items[i].delivery.properties,
                items[i].delivery.data.as_slice(),
            )
        })
        .collect();
    let moved = mover.send(&msgs).await?;
    Ok(idx
        .into_iter()
        .zip(digests)
        .zip(moved)
        .map(|((i, d), m)| (i, d, m))
        .collect())
}

impl Drain<'_> {
    /// Move what the step does not take (skipped, held back, failed), then record the step
    /// (audit rows, settled marks, counts) atomically, then ack what is settled (the moved
    /// originals once their copies are confirmed, see [`Drain::pend`]).
    pub(super) async fn settle(&mut self, items: Vec<Item>) -> Result<(), Error> {
        let moves = keep_moves(self.keeper.as_mut(), &items).await;
        let mut items = items;
        let record = self.record(&mut items);
        let moved = moves.map(|m| self.pend(&items, m));
        let answer = record.commit(&mut self.store).await;
        // A failed move leaves its messages unacked; the rest is recorded and acked.
        self.recorded(record, answer).await.and(moved)
    }

    /// Hold the originals of a step's moves until their copies are confirmed: the step lands
    /// without waiting for them. A copy into a queue nobody consumes is confirmed once the
    /// broker has written it to disk, a few milliseconds that a landing waiting for them added
    /// to the whole drain (bench/RESULTS.md, canary section). Their acks follow at a later
    /// landing ([`Drain::ack_moved`]); until then the original holds its place in the queue,
    /// and a crash leaves both, which the move ledger settles.
    pub(super) fn pend(&mut self, items: &[Item], moves: Vec<(usize, String, keep::Copy)>) {
        for (i, digest, copy) in moves {
            let tag = items[i].delivery.delivery_tag;
            self.pending
                .push(Box::pin(async move { (tag, digest, copy.moved().await) }));
        }
    }

    /// Act on the moves whose copies the broker has answered for (all of them, waiting, when
    /// `wait`): a confirmed copy's original is acked, and its ledger count comes back once the
    /// queue has applied the ack (see `recorded`); a refused copy means no copy exists, so its
    /// count comes back now and the original stays; an unconfirmed one may exist, so its count
    /// stays, and so does the original.
    pub(super) async fn ack_moved(&mut self, wait: bool) -> Result<(), Error> {
        use futures::{FutureExt, StreamExt};
        let mut done = Vec::new();
        if wait {
            while let Some(m) = self.pending.next().await {
                done.push(m);
            }
        } else {
            while let Some(Some(m)) = self.pending.next().now_or_never() {
                done.push(m);
            }
        }
        if done.is_empty() {
            return Ok(());
        }
        let (mut copied, mut digests, mut refused) = (Vec::new(), Vec::new(), Vec::new());
        for (tag, digest, moved) in done {
            match moved {
                keep::Moved::Copied => {
                    copied.push(tag);
                    digests.push(digest);
                }
                keep::Moved::Refused => refused.push(digest),
                keep::Moved::Unknown => {}
            }
        }
        if !copied.is_empty() {
            let src = self
                .source
                .as_mut()
                .ok_or_else(|| Error::Broker("source closed".into()))?;
            src.ack_held(&copied).await?;
            self.last_moved.extend(digests);
        }
        if !refused.is_empty() {
            if let Some((_, ledger)) = self.keeper.as_mut() {
                ledger.take_back(&refused).await?;
            }
        }
        Ok(())
    }

    /// What a step's landing writes and acks, from its items' outcomes.
    /// The items' identities, fingerprints, signatures and keys move into the rows (a
    /// landing needs no more of them than their acts, digests and deliveries).
    pub(super) fn record(&mut self, items: &mut [Item]) -> Record {
        let mut rows = Vec::new();
        let mut settled = Vec::new();
        let mut claims = Vec::new();
        let mut delta = Counts::default();
        let mut acks = Vec::new();
        let mut unknown = 0u32;
        let mut unknown_why = String::new();
        // Unconfirmed publishes end the pass after this step (and the steps in flight).
        self.ending |= items.iter().any(|it| matches!(it.act, Act::Unknown(_)));
        let ending = self.ending;
        let time = now();
        let claiming = self.claiming();
        // Kept messages (skipped, failed) are acked by their moves ([`Record::moved`]), never
        // here.
        for item in items.iter_mut() {
            if item.canary {
                self.canary_landed(item);
            }
            let (decision, reason, destination) = match &item.act {
                Act::AlreadySettled => {
                    acks.push(item.delivery.delivery_tag);
                    continue;
                }
                Act::Skip { returned, .. } => {
                    delta.scanned += 1;
                    delta.skipped += 1;
                    delta.returned += u64::from(*returned);
                    continue;
                }
                Act::Leftover => {
                    delta.duplicates += 1;
                    (
                        Decision::Duplicate,
                        "LeftoverCopy: a second copy of a message this pass already met, left by an interrupted move".to_string(),
                        String::new(),
                    )
                }
                Act::Replayed(d) => {
                    delta.replayed += 1;
                    if claiming {
                        if let Some(k) = &item.key {
                            claims.push(self.claim_end(k, true));
                        }
                    }
                    (Decision::Replayed, String::new(), d.label())
                }
                Act::Quarantined(r) => {
                    delta.quarantined += 1;
                    (
                        Decision::Quarantined,
                        r.clone(),
                        self.replay.spec.quarantine.queue.clone(),
                    )
                }
                Act::Duplicate { reason, .. } => {
                    delta.duplicates += 1;
                    (Decision::Duplicate, reason.clone(), String::new())
                }
                Act::Failed(r) => {
                    if claiming {
                        if let Some(k) = &item.key {
                            claims.push(self.claim_end(k, false));
                        }
                    }
                    if ending {
                        // It stays in the queue for the next pass, which decides (and counts)
                        // it again: recording it here too would count it twice.
                        continue;
                    }
                    delta.failed += 1;
                    (Decision::Failed, r.clone(), String::new())
                }
                Act::Unknown(why) => {
                    unknown += 1;
                    unknown_why.clone_from(why);
                    continue;
                }
                Act::Unsent => {
                    if claiming {
                        if let Some(k) = &item.key {
                            claims.push(self.claim_end(k, false));
                        }
                    }
                    continue;
                }
                // Publish resolves every Replay and Quarantine; set-aside ones left the step.
                Act::Replay(_) | Act::Quarantine(_) | Act::Aside(_) => continue,
            };
            delta.scanned += 1;
            if decision != Decision::Failed {
                if !matches!(item.act, Act::Leftover) {
                    settled.push((
                        std::mem::take(&mut item.fingerprint),
                        decision.as_str().to_string(),
                    ));
                }
                if decision == Decision::Replayed {
                    if let Some(k) = &item.key {
                        settled.push((store::key_field(k), item.identity.clone()));
                    }
                }
                acks.push(item.delivery.delivery_tag);
            }
            rows.push(AuditRow {
                id: String::new(),
                replay: self.replay_id.clone(),
                message: std::mem::take(&mut item.identity),
                decision: decision.as_str().into(),
                key: item.key.take().unwrap_or_default(),
                reason,
                destination,
                canary: item.canary,
                time: time.clone(),
                signature: std::mem::take(&mut item.signature),
            });
        }
        acks.sort_unstable();
        Record {
            tags: items.iter().map(|it| it.delivery.delivery_tag).collect(),
            rows,
            settled,
            claims,
            delta,
            acks,
            unknown,
            unknown_why,
        }
    }

    fn claiming(&self) -> bool {
        super::gate::claim(self.replay, &self.claim_value).is_some()
    }

    /// After the step's commit: counts, acks, the move ledger, and the end of the pass when a
    /// publish was left unconfirmed.
    pub(super) async fn recorded(
        &mut self,
        record: Record,
        answer: Result<(u64, u64), Error>,
    ) -> Result<(), Error> {
        let (records, again) = match answer {
            Ok(a) => a,
            Err(e) => {
                // Not recorded, so not acked: no later step's multiple ack may cover it.
                if let Some(src) = self.source.as_mut() {
                    src.ack(&[], &record.tags).await?;
                }
                return Err(e);
            }
        };
        let Record {
            tags,
            delta,
            acks,
            unknown,
            unknown_why,
            ..
        } = record;
        if self.claiming() && again > 0 {
            // The invariant Claim mode exists for broke: say so loudly, and count it.
            tracing::error!(replay = %self.replay_id, keys = again, "Claim mode published a key twice");
            crate::observe::observer().published_twice(again);
        }
        add(&mut self.status.counts, &delta);
        if let Some(a) = self.status.audit.as_mut() {
            a.records = records;
        }
        let held: Vec<u64> = tags
            .into_iter()
            .filter(|t| acks.binary_search(t).is_err())
            .collect();
        let src = self
            .source
            .as_mut()
            .ok_or_else(|| Error::Broker("source closed".into()))?;
        src.ack(&acks, &held).await?;
        // The moves' ledger counts come back once the queue has applied the originals' acks
        // (see source::get_one): the pass takes its last message with basic.get after every
        // other ack, which makes sure of that for every ack sent before the latest landing;
        // those are taken back when the pass closes, the latest landing's stay for the next
        // traversal to settle.
        let earlier = std::mem::take(&mut self.last_moved);
        self.moved.extend(earlier);
        self.ack_moved(false).await?;
        if unknown > 0 {
            // What was confirmed is recorded and acked; the unconfirmed wait for the next pass,
            // which finds their claims (or publishes them again in Check mode) like a rerun.
            let closed = if self.publisher.connection().is_open() {
                "the publishing channel closed"
            } else {
                "connection lost"
            };
            return Err(Error::Connection(format!(
                "{closed} with {unknown} publishes unconfirmed ({unknown_why})"
            )));
        }
        Ok(())
    }

    /// Take back the ledger counts of the messages moved before the pass's last step (a pass
    /// that ended early leaves them for the next traversal to settle).
    pub(super) async fn take_back_moved(&mut self) {
        let Some((_, ledger)) = self.keeper.as_mut() else {
            return;
        };
        for chunk in std::mem::take(&mut self.moved).chunks(4096) {
            if let Err(e) = ledger.take_back(chunk).await {
                tracing::warn!(error = %e, "taking back the move ledger's counts");
                return;
            }
        }
    }

    /// The end of this attempt's claim on `key`: published, or released.
    fn claim_end(&self, key: &str, published: bool) -> store::ClaimEnd {
        store::ClaimEnd {
            key: key.to_string(),
            value: self.claim_value.clone(),
            published,
        }
    }
}
