//! What a replay reports as it goes: its phase, counts, canaries and audit reference. The
//! operator writes this into the resource's `status` beside what only a cluster has (conditions,
//! the generation observed); the CLI draws it as a progress bar and keeps it in Redis.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::spec::{is_default, AuditSink};

/// Where a replay is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum Phase {
    /// Waiting for its pre-flight checks (credentials, queues, consumer, backlog).
    Pending,
    /// `spec.requireApproval`: planned, nothing moved; waiting for a person to approve the plan
    /// (`status.plan.digest` in the annotation `replay.dlq.dev/approve`).
    AwaitingApproval,
    /// Canary messages are out; waiting to see whether they come back.
    Canary,
    /// Replaying the selected messages.
    Draining,
    /// Every selected message has its outcome.
    Done,
    /// A canary came back: every canary did (`canary.onFailure: HoldSignature`), or one did with
    /// `StopReplay`. The fix does not hold; what was not replayed stays in the dead-letter queue.
    CanaryFailed,
    /// Stopped with an error; what is not settled is still in the dead-letter queue.
    Failed,
    /// Paused by `spec.suspend`.
    Suspended,
}

impl Phase {
    /// A phase the replay does not leave by itself.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Done | Phase::CanaryFailed | Phase::Failed)
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// The observed state of a replay, as the engine sees it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplayStatus {
    /// Pending, AwaitingApproval, Canary, Draining, Done, CanaryFailed, Failed or Suspended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// The id tagged on every replayed message as `x-replay-id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_id: Option<String>,
    /// How many messages the dead-letter queue held when the replay started; the replay takes at
    /// most these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_depth_at_start: Option<u64>,
    /// What happened to the messages so far.
    #[serde(default)]
    pub counts: Counts,
    /// The canaries, one per failure signature.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub canary: Vec<CanaryStatus>,
    /// Signatures met that `spec.expect.signatures` does not approve, with how many of their
    /// messages this run held back (left in the dead-letter queue).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub not_approved: std::collections::BTreeMap<String, u64>,
    /// Where the audit trail is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditRef>,
    /// When the replay started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    /// When the replay reached a terminal phase (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// A one-line human summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Set when the replay runs on a Redis that may evict the workers' done marks, because
    /// `spec.audit.acceptRedisEviction` accepted the risk: what the pre-flight found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis_eviction_risk: Option<String>,
}

/// Decisions so far. `scanned = replayed + duplicates + quarantined + skipped + failed`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    /// Messages looked at.
    pub scanned: u64,
    /// Published to the target, confirmed.
    pub replayed: u64,
    /// Dropped because their work already happened (idempotency store).
    pub duplicates: u64,
    /// Published to the quarantine queue, confirmed.
    pub quarantined: u64,
    /// Left in the dead-letter queue untouched (not selected, held back, or came back).
    pub skipped: u64,
    /// Could not be published (nacked or unroutable); left in the dead-letter queue.
    pub failed: u64,
    /// Replayed messages that died again and came back while the replay ran.
    #[serde(default)]
    pub returned: u64,
}

impl Counts {
    /// The fields by name, as status spells them: the one list the store, the metrics and the
    /// engine's sums go by.
    pub fn by_field(&self) -> [(&'static str, u64); 7] {
        [
            ("scanned", self.scanned),
            ("replayed", self.replayed),
            ("duplicates", self.duplicates),
            ("quarantined", self.quarantined),
            ("skipped", self.skipped),
            ("failed", self.failed),
            ("returned", self.returned),
        ]
    }

    /// The field named `name` (as [`Counts::by_field`] names it).
    pub fn field_mut(&mut self, name: &str) -> Option<&mut u64> {
        Some(match name {
            "scanned" => &mut self.scanned,
            "replayed" => &mut self.replayed,
            "duplicates" => &mut self.duplicates,
            "quarantined" => &mut self.quarantined,
            "skipped" => &mut self.skipped,
            "failed" => &mut self.failed,
            "returned" => &mut self.returned,
            _ => return None,
        })
    }

    /// Counts whose every field is `value(name)` ([`Counts::by_field`]'s names).
    pub fn from_fields(value: impl Fn(&str) -> u64) -> Counts {
        let mut c = Counts::default();
        for (name, _) in Counts::default().by_field() {
            if let Some(f) = c.field_mut(name) {
                *f = value(name);
            }
        }
        c
    }

    /// What a plan with these counts would do, in words: "would replay R, drop D duplicates,
    /// quarantine Q, skip S".
    pub fn would(&self) -> String {
        format!(
            "would replay {}, drop {} duplicates, quarantine {}, skip {}",
            self.replayed, self.duplicates, self.quarantined, self.skipped
        )
    }

    /// Add `other`, field by field.
    pub fn add(&mut self, other: &Counts) {
        for (name, n) in other.by_field() {
            if let Some(f) = self.field_mut(name) {
                *f += n;
            }
        }
    }
}

/// One canary.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CanaryStatus {
    /// The failure signature the canary stands for.
    pub signature: String,
    /// The canary message's identity (message id or body hash).
    pub message_id: String,
    /// When it was published (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_at: Option<String>,
    /// Until when its return is watched for (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_until: Option<String>,
    /// Waiting, Passed, Confirmed, DiedAgain or Unconfirmed.
    pub result: CanaryResult,
    /// Why it died again: the new death's reason and, when present, the signature header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// How many messages of this signature were selected.
    #[serde(default)]
    pub messages: u64,
}

/// The outcome of one canary.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum CanaryResult {
    /// Out; the wait is not over.
    #[default]
    Waiting,
    /// Did not come back within the wait.
    Passed,
    /// The worker marked its key done within the wait.
    Confirmed,
    /// Came back with a new death: this signature's messages are held back.
    DiedAgain,
    /// `requireDone`: the worker did not mark its key done within the wait; held back.
    Unconfirmed,
}

/// Where the audit trail of a replay is.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuditRef {
    /// The Redis stream that holds one row per decision (with `sink: Log`, the rows are in the
    /// log instead, and this key names the replay run they carry as `replay`).
    pub key: String,
    /// How many rows it holds.
    pub records: u64,
    /// Where the rows went (`spec.audit.sink`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub sink: AuditSink,
}

#[cfg(test)]
mod tests {
    use super::Counts;

    #[test]
    fn every_count_field_is_named_once_and_addressed_by_its_name() {
        let mut c = Counts::default();
        for (i, (name, _)) in Counts::default().by_field().into_iter().enumerate() {
            *c.field_mut(name).expect(name) = i as u64 + 1;
        }
        let values: Vec<u64> = c.by_field().iter().map(|(_, n)| *n).collect();
        assert_eq!(values, (1..=7).collect::<Vec<_>>(), "{c:?}");
        // The names are status's own (camelCase serde names).
        let json = serde_json::to_value(c).unwrap();
        for (name, n) in c.by_field() {
            assert_eq!(json[name], n, "{name}");
        }
        let mut sum = c;
        sum.add(&c);
        assert_eq!(sum.returned, 2 * c.returned);
        assert_eq!(sum.scanned, 2);
    }
}
