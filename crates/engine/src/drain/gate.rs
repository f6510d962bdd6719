//! The gate: one Redis round trip per step that looks up every message's settled marks and
//! checks (Check mode) or claims (Claim mode) its idempotency key.

use super::{Act, Drain, Item};
use crate::spec::IdempotencyMode;
use crate::store::{self, Store};
use crate::Error;
use crate::Replay;

/// The claim this attempt takes on each key (Claim mode): its value and expiry.
pub(super) fn claim<'a>(replay: &Replay, value: &'a str) -> Option<(&'a str, u64)> {
    replay
        .spec
        .idempotency
        .as_ref()
        .filter(|i| i.mode == IdempotencyMode::Claim)
        .map(|i| (value, i.ttl_seconds))
}

/// The items of a step that ask the gate (replays and quarantines), by index.
pub(super) struct Ask(Vec<usize>);

impl Ask {
    pub(super) fn of(items: &[Item]) -> Self {
        Self(
            (0..items.len())
                .filter(|&i| matches!(items[i].act, Act::Replay(_) | Act::Quarantine(_)))
                .collect(),
        )
    }

    /// One round trip: the settled marks of every asking item, and its key checked or claimed.
    pub(super) async fn lookup(
        &self,
        store: &mut Store,
        items: &[Item],
        claim: Option<(&str, u64)>,
    ) -> Result<Vec<store::Lookup>, Error> {
        if self.0.is_empty() {
            return Ok(Vec::new());
        }
        let key_fields: Vec<Option<String>> = self
            .0
            .iter()
            .map(|&i| items[i].key.as_deref().map(store::key_field))
            .collect();
        let fields: Vec<(&str, Option<&str>)> = self
            .0
            .iter()
            .zip(&key_fields)
            .map(|(&i, k)| (items[i].fingerprint.as_str(), k.as_deref()))
            .collect();
        let keys: Vec<Option<&str>> = self
            .0
            .iter()
            .map(|&i| match items[i].act {
                Act::Replay(_) => items[i].key.as_deref(),
                _ => None,
            })
            .collect();
        store.lookup(&fields, &keys, claim).await
    }
}

impl Drain<'_> {
    /// The idempotency gate and the resume check, in one Redis round trip for the step.
    pub(super) async fn gate(&mut self, items: &mut [Item]) -> Result<(), Error> {
        let ask = Ask::of(items);
        let lookups = ask
            .lookup(
                &mut self.store,
                items,
                claim(self.replay, &self.claim_value),
            )
            .await?;
        self.decide(items, &ask, lookups);
        Ok(())
    }

    /// Each item's act after the lookup: a duplicate, an unknown outcome to quarantine, a
    /// message settled before, or what classify made of it; then `spec.expect`'s maximums on
    /// what is left to publish ([`Drain::hold_to_expectations`]).
    pub(super) fn decide(&mut self, items: &mut [Item], ask: &Ask, lookups: Vec<store::Lookup>) {
        let asks = &ask.0;
        let idem = self.replay.spec.idempotency.as_ref();
        let claim = claim(self.replay, &self.claim_value);
        let done = idem.map(|i| i.done_value.as_str()).unwrap_or("");
        let prefix = format!("{}/", self.replay_id);
        for (&i, l) in asks.iter().zip(lookups) {
            let item = &mut items[i];
            if item.delivery.redelivered && l.settled.is_some() {
                // Settled by an earlier run whose ack was lost: its audit row exists already.
                item.act = Act::AlreadySettled;
                continue;
            }
            if !matches!(item.act, Act::Replay(_)) || item.key.is_none() {
                continue;
            }
            item.act = match (claim, l.value.as_deref()) {
                (_, Some(v)) if v == done => Act::Duplicate { reason: "key is done".into(), same_attempt: false },
                (None, _) => continue,
                (Some(_), _) if l.claimed => continue,
                (Some((mine, _)), Some(v)) if v == mine => Act::Duplicate {
                    reason: "key already replayed by this replay".into(),
                    same_attempt: true,
                },
                (Some(_), Some(v)) if v.starts_with(&prefix) => match l.key_replayed {
                    Some(_) => Act::Duplicate { reason: "key already replayed by this replay".into(), same_attempt: false },
                    // Claimed by an earlier run of this replay that crashed before recording
                    // the outcome: it may or may not have been published. Never twice.
                    None => Act::Quarantine(
                        "OutcomeUnknown: claimed by an earlier run of this replay that stopped before recording the publish".into(),
                    ),
                },
                (Some(_), Some(v)) => match store::Held::of(Some(v), done) {
                    // Another replay claimed it and never recorded a confirmed publish: its work
                    // may never have gone out, so it is not dropped as a duplicate.
                    held @ store::Held::Unconfirmed(_) => Act::Quarantine(format!(
                        "OutcomeUnknown: claimed by replay {} without a confirmed publish",
                        held.replay().unwrap_or_default()
                    )),
                    _ => Act::Duplicate { reason: format!("key is claimed ({v})"), same_attempt: false },
                },
                // The claim was refused but the key vanished in between (expired): leave it.
                (Some(_), None) => Act::Failed("claim refused, then the key vanished; left in the queue".into()),
            };
        }
        self.hold_to_expectations(items);
    }
}
