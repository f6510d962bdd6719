//! `spec.expect`: the most a replay may do, as a reviewer approved it, and the one test of it
//! that the drain, `plan`, the operator and the CLI share.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The most a replay may do (`spec.expect`), as a reviewer approved it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExpectSpec {
    /// The failure signatures approved for replay, as `dlq-replay plan` and the status name them
    /// (the `canary.signatureHeader` value as `header=value`, else `reason@queue` of the most
    /// recent death). A message of any other signature is held back: it stays in the dead-letter
    /// queue with its bytes unchanged and in order (moved to the tail), counted as `skipped`
    /// with the reason `NotApproved`, and listed in `status.notApproved`; it gets no canary.
    /// Empty: every signature.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1000), inner(length(min = 1, max = 1024)))]
    pub signatures: Vec<String>,
    /// The most messages to replay (canaries included; at least 1). Before publishing one more,
    /// the replay stops: `Failed`, with a message that says so; what it did not replay stays in
    /// the dead-letter queue. To replay more, review a new replay with a higher limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_replayed: Option<u64>,
    /// The most messages to quarantine (0: none expected). Before quarantining one more, the
    /// replay stops as for `maxReplayed`: more poison than reviewed means the queue is not what
    /// was approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_quarantined: Option<u64>,
}

impl ExpectSpec {
    /// Whether `signature` may be replayed: the one test of approval, for `run` and `plan`.
    pub fn approves(&self, signature: &str) -> bool {
        self.signatures.is_empty() || self.signatures.iter().any(|s| s == signature)
    }

    /// The limits that hold both `self` and `other`: the signatures both approve and the lower
    /// of each maximum. When the two lists share no signature, no replay is left (a maximum of
    /// 0), never an empty list (which approves every signature).
    pub fn narrowed(&self, other: &ExpectSpec) -> ExpectSpec {
        let min = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mut max_replayed = min(self.max_replayed, other.max_replayed);
        let signatures = match (self.signatures.is_empty(), other.signatures.is_empty()) {
            (true, _) => other.signatures.clone(),
            (_, true) => self.signatures.clone(),
            _ => {
                let both: Vec<String> = self
                    .signatures
                    .iter()
                    .filter(|s| other.signatures.contains(s))
                    .cloned()
                    .collect();
                if both.is_empty() {
                    max_replayed = Some(0);
                }
                both
            }
        };
        ExpectSpec {
            signatures,
            max_replayed,
            max_quarantined: min(self.max_quarantined, other.max_quarantined),
        }
    }

    /// Why publishing one more message as `what` (`Replayed` or `Quarantined`) would go past
    /// its maximum, with `done` such messages published or on their way: the reason the replay
    /// stops, or `None` when there is room.
    pub fn exceeded(&self, what: Published, done: u64) -> Option<String> {
        let (max, field) = match what {
            Published::Replayed => (self.max_replayed?, "maxReplayed"),
            Published::Quarantined => (self.max_quarantined?, "maxQuarantined"),
        };
        (done >= max).then(|| {
            format!(
                "ExpectationReached: spec.expect.{field} is {max} and {done} are {}; the rest stays in the dead-letter queue (review a new replay to go on)",
                what.as_str()
            )
        })
    }
}

/// What a publish makes of a message, for the limits of [`ExpectSpec`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    /// Replayed to its target.
    Replayed,
    /// Sent to quarantine.
    Quarantined,
}

impl Published {
    fn as_str(self) -> &'static str {
        match self {
            Published::Replayed => "replayed",
            Published::Quarantined => "quarantined",
        }
    }
}
