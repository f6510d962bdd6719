//! What each delivery of a step becomes (replayed, quarantined, skipped, held back, set aside
//! for a canary, a canary itself, a leftover copy of an earlier move), before the gate asks
//! Redis about it.

use crate::amqp::Delivery;

use super::{Act, Aside, Drain, Item};
use crate::canary::Gate;
use crate::classify::{self, Rules, SkipReason, Verdict};
use crate::spec::Published;
use crate::{message, watch};

/// A delivery on its way into a step: fresh from the queue, or set aside before and released
/// (its move-ledger meeting made when it was fresh).
pub(super) struct Input {
    pub delivery: Delivery,
    pub met: Option<(String, bool)>,
    /// Set aside too long (see `HOLD_MAX`): left in the queue.
    pub expired: bool,
}

impl From<Aside> for Input {
    fn from(a: Aside) -> Self {
        Self {
            expired: a.overdue(),
            delivery: a.delivery,
            met: a.met,
        }
    }
}

/// The longest a delivery stays set aside: RabbitMQ closes a channel holding a delivery unacked
/// for `consumer_timeout` (30 min by default), which would hand everything back. A delivery set
/// aside this long (a `canary.waitSeconds` near 30 min, or a queue Pending that long) is moved to
/// the tail like a skipped one, for a later run.
pub(super) const HOLD_MAX: std::time::Duration = std::time::Duration::from_secs(25 * 60);

impl Drain<'_> {
    /// Whether `spec.expect` approves the signature (every one without it).
    fn approves(&self, signature: &str) -> bool {
        self.replay
            .spec
            .expect
            .as_ref()
            .is_none_or(|e| e.approves(signature))
    }

    /// `spec.expect`'s maximums on a step the gate has decided (duplicates are known, so they
    /// do not count): its replays and quarantines, in order, until one more would go past a
    /// maximum. From that one on nothing is published (left unacked: back in the queue when the
    /// pass closes), and the pass ends `Failed` saying which maximum was reached. The publishes
    /// counted are those admitted, confirmed or not, so none is ever past the maximum.
    pub(super) fn hold_to_expectations(&mut self, items: &mut [Item]) {
        let Some(expect) = self.replay.spec.expect.as_ref() else {
            return;
        };
        for it in items.iter_mut() {
            let (what, done) = match it.act {
                Act::Replay(_) => (Published::Replayed, &mut self.published.0),
                Act::Quarantine(_) => (Published::Quarantined, &mut self.published.1),
                _ => continue,
            };
            if self.refused.is_some() {
                it.act = Act::Unsent;
                continue;
            }
            match expect.exceeded(what, *done) {
                Some(why) => {
                    self.refused = Some(why);
                    it.act = Act::Unsent;
                }
                None => *done += 1,
            }
        }
    }

    pub(super) fn limit_reached(&self) -> bool {
        self.replay
            .spec
            .selector
            .limit
            .is_some_and(|l| self.selected >= l)
    }

    /// Fresh deliveries: counted against the pass's bound, their routes noted, met by the move
    /// ledger (once: a released delivery keeps its meeting).
    pub(super) fn fresh(&mut self, deliveries: Vec<Delivery>) -> Vec<Input> {
        let mut out = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            if self.seen >= self.bound {
                // Prefetched beyond the bound: not ours; it goes back untouched when the channel
                // closes.
                break;
            }
            self.seen += 1;
            watch::note_route(&mut self.routes, &delivery);
            let met = self
                .keeper
                .as_mut()
                .and_then(|(_, ledger)| ledger.meet(&delivery.properties, &delivery.data));
            out.push(Input {
                delivery,
                met,
                expired: false,
            });
        }
        out
    }

    pub(super) fn classify(&mut self, inputs: Vec<Input>, fresh: bool) -> Vec<Item> {
        let replay = self.replay;
        // Its own copy: classifying a step mutates the drain.
        let replay_id = self.replay_id.clone();
        let rules = Rules::of(&replay.spec, &replay_id);
        inputs
            .into_iter()
            .map(|input| self.classify_one(&rules, input, fresh))
            .collect()
    }

    fn classify_one(&mut self, rules: &Rules, input: Input, fresh: bool) -> Item {
        let Input {
            delivery,
            met,
            expired,
        } = input;
        let props = &delivery.properties;
        let identity = message::identity(props, &delivery.data);
        let fingerprint = message::fingerprint(props, &delivery.data);
        let signature = classify::signature(&self.replay.spec.canary.signature_header, props);
        let mut item = Item {
            delivery,
            identity,
            fingerprint,
            signature,
            digest: None,
            key: None,
            act: Act::Leftover,
            canary: false,
            met: None,
        };
        if self.canary.opening() {
            // The first look-ahead is read and set aside whole: what it holds is decided before
            // anything moves.
            let verdict = classify::classify(rules, &item.delivery.properties, &item.delivery.data);
            let (sig, poison, landing) = match &verdict {
                // Not approved: no canary, no pre-flight, not one of the signatures counted.
                Verdict::Replay { .. } if !self.approves(&item.signature) => (None, false, None),
                Verdict::Replay { .. } => (
                    Some(item.signature.as_str()),
                    false,
                    crate::canary::landing_queue(&self.replay.spec, &item.delivery),
                ),
                Verdict::Poison(_) => (None, true, None),
                Verdict::Skip(_) => (None, false, None),
            };
            self.canary.note_opening(sig, poison, landing);
            item.act = Act::Aside(None);
            item.met = met;
            return item;
        }
        if let Some((d, true)) = met {
            item.digest = Some(d);
            return item;
        }
        item.digest = met.as_ref().map(|(d, _)| d.clone());
        item.met = met;
        let verdict = if expired {
            Verdict::Skip(SkipReason::NotSelected(
                "set aside for 25 min waiting for a canary: left in the queue for the next run"
                    .into(),
            ))
        } else if self.limit_reached() {
            Verdict::Skip(SkipReason::NotSelected("selector.limit reached".into()))
        } else {
            classify::classify(rules, &item.delivery.properties, &item.delivery.data)
        };
        let (act, key) = match verdict {
            Verdict::Skip(SkipReason::Returned) => (
                Act::Skip {
                    reason: "returned: died again after this replay".into(),
                    returned: true,
                },
                None,
            ),
            Verdict::Skip(SkipReason::NotSelected(r)) => (
                Act::Skip {
                    reason: r,
                    returned: false,
                },
                None,
            ),
            Verdict::Poison(r) => (Act::Quarantine(r), None),
            Verdict::Replay { .. } if !self.approves(&item.signature) => {
                let n = self.status.not_approved.entry(item.signature.clone());
                *n.or_default() += 1;
                (
                    Act::Skip {
                        reason: format!(
                            "NotApproved: signature {:?} is not in spec.expect.signatures",
                            item.signature
                        ),
                        returned: false,
                    },
                    None,
                )
            }
            Verdict::Replay { key, destination } => {
                if fresh {
                    self.canary.count(&item.signature);
                }
                match self.canary.gate(&item.signature) {
                    Gate::Go => (Act::Replay(destination), key),
                    Gate::Canary => {
                        item.canary = true;
                        (Act::Replay(destination), key)
                    }
                    Gate::Aside => (Act::Aside(Some(item.signature.clone())), None),
                    Gate::Held => {
                        *self.canary.held.entry(item.signature.clone()).or_default() += 1;
                        (
                            Act::Skip {
                                reason: "held back: the canary of its signature did not pass"
                                    .into(),
                                returned: false,
                            },
                            None,
                        )
                    }
                    Gate::TooMany(why) => {
                        // Stays unacked (back in the queue when the pass closes): the pass ends.
                        self.refused.get_or_insert(why);
                        (Act::Aside(Some(item.signature.clone())), None)
                    }
                }
            }
        };
        if !matches!(act, Act::Skip { .. } | Act::Aside(_)) {
            self.selected += 1;
        }
        item.act = act;
        item.key = key;
        item
    }
}
