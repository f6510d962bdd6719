//! What each delivery of a step becomes (replayed, quarantined, skipped, held back, a
//! leftover copy of an earlier move), before the gate asks Redis about it.

use lapin::message::Delivery;

use super::{Act, Drain, Item};
use crate::classify::{self, Rules, SkipReason, Verdict};
use crate::{message, proven, watch};

impl Drain<'_> {
    pub(super) fn limit_reached(&self) -> bool {
        self.replay
            .spec
            .selector
            .limit
            .is_some_and(|l| self.selected >= l)
    }

    pub(super) fn classify(&mut self, deliveries: Vec<Delivery>) -> Vec<Item> {
        let rules = Rules::of(&self.replay.spec, &self.replay_id);
        let mut items = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            if self.seen >= self.bound {
                // Prefetched beyond the bound: not ours; it goes back untouched when the channel
                // closes.
                break;
            }
            self.seen += 1;
            watch::note_route(&mut self.routes, &delivery);
            let props = &delivery.properties;
            let identity = message::identity(props, &delivery.data);
            let fingerprint = message::fingerprint(props, &delivery.data);
            let signature = classify::signature(&self.replay.spec.canary.signature_header, props);
            let met = self
                .keeper
                .as_mut()
                .and_then(|(_, ledger)| ledger.meet(props, &delivery.data));
            if let Some((d, true)) = met {
                items.push(Item {
                    delivery,
                    identity,
                    fingerprint,
                    signature,
                    digest: Some(d),
                    key: None,
                    act: Act::Leftover,
                });
                continue;
            }
            let digest = met.map(|(d, _)| d);
            let verdict = if self.limit_reached() {
                Verdict::Skip(SkipReason::NotSelected("selector.limit reached".into()))
            } else {
                classify::classify(&rules, props, &delivery.data)
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
                Verdict::Replay { key, destination } => {
                    match hold(&self.proven, &mut self.unproven, &signature) {
                        Some(reason) => (
                            Act::Skip {
                                reason,
                                returned: false,
                            },
                            None,
                        ),
                        None => (Act::Replay(destination), key),
                    }
                }
            };
            if !matches!(act, Act::Skip { .. }) {
                self.selected += 1;
            }
            items.push(Item {
                delivery,
                identity,
                fingerprint,
                signature,
                digest,
                key,
                act,
            });
        }
        items
    }
}

/// Why a replayable message stays in the queue (its signature's canary did not pass, or none
/// met it), counting the unproven ones in `unproven` for the end message.
fn hold(
    proven: &proven::Proven,
    unproven: &mut std::collections::BTreeMap<String, u64>,
    sig: &str,
) -> Option<String> {
    if let proven::Proven::All = proven {
        return None;
    }
    let hold = proven.hold(sig)?;
    let reason = hold.reason(sig);
    if hold == proven::Hold::Unproven {
        *unproven.entry(sig.to_string()).or_default() += 1;
    }
    Some(reason)
}
