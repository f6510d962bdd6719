//! The `DlqReplay` resource: spec and status.
//!
//! The same types serve `kubectl apply` (through the generated CRD in `crds/`) and
//! `dlq-replay run -f` (through [`crate::manifest`]). Doc comments on fields become the schema
//! descriptions that `kubectl explain dlqreplay.spec...` prints, so they are written for the SRE
//! reading them, not for the Rust reader.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of the resource.
pub const GROUP: &str = "replay.dlq.dev";
/// The `apiVersion` a manifest must carry.
pub const API_VERSION: &str = "replay.dlq.dev/v1alpha1";
/// The `kind` a manifest must carry.
pub const KIND: &str = "DlqReplay";

/// A replay of a RabbitMQ dead-letter queue: which messages to put back, where, how fast, and
/// which guards (poison gate, idempotency store, canary) stand in the way of a second failure.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "replay.dlq.dev",
    version = "v1alpha1",
    kind = "DlqReplay",
    plural = "dlqreplays",
    shortname = "dlqr",
    namespaced,
    status = "DlqReplayStatus",
    doc = "A safe, audited replay of a RabbitMQ dead-letter queue.",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Replayed","type":"integer","jsonPath":".status.counts.replayed"}"#,
    printcolumn = r#"{"name":"Duplicates","type":"integer","jsonPath":".status.counts.duplicates"}"#,
    printcolumn = r#"{"name":"Quarantined","type":"integer","jsonPath":".status.counts.quarantined"}"#,
    printcolumn = r#"{"name":"Failed","type":"integer","jsonPath":".status.counts.failed"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.message"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DlqReplaySpec {
    /// The RabbitMQ broker that holds the dead-letter queue and receives the replayed messages.
    pub broker: ConnectionSpec,
    /// The dead-letter queue to replay.
    pub source: SourceSpec,
    /// Where replayed messages go. Empty (the default): each message goes back to the exchange and
    /// routing key it was first published with, as recorded in its most recent `x-death` entry.
    #[serde(default)]
    pub target: TargetSpec,
    /// Where poison messages go: they are never replayed, and a human decides what to do with them.
    pub quarantine: QuarantineSpec,
    /// Which messages this replay takes. Messages that do not match stay in the dead-letter queue
    /// with body, properties and headers unchanged, in their relative order.
    #[serde(default)]
    pub selector: SelectorSpec,
    /// The poison gate: messages that would die again deterministically go to quarantine.
    #[serde(default)]
    pub poison: PoisonSpec,
    /// The idempotency gate: drop messages whose work already happened. Absent: no gate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency: Option<IdempotencySpec>,
    /// Where the audit trail and the replay's own state are kept. Defaults to the idempotency
    /// store's Redis when that is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditSpec>,
    /// The rate limit of replayed messages. Absent: as fast as the broker confirms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<RateSpec>,
    /// The canary: prove the fix on one message per failure signature before draining the rest.
    #[serde(default)]
    pub canary: CanarySpec,
    /// Classify every message and report the counts, without publishing, acking, claiming or
    /// writing anything. The dead-letter queue is left exactly as it was.
    #[serde(default)]
    pub dry_run: bool,
    /// Pause the replay once the messages in flight have settled; set back to false to resume.
    #[serde(default)]
    pub suspend: bool,
}

/// How to reach a server: an inline URL (for local runs) or a key of a Secret in the replay's
/// namespace. Exactly one of the two, or none when the command line supplies it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConnectionSpec {
    /// The URL, e.g. `amqp://user:pass@host:5672/vhost` or `redis://host:6379/0`; `amqps://` and
    /// `rediss://` use TLS. Prefer `urlSecretRef` for anything but local runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// A key of a Secret in the replay's namespace that holds the URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
}

/// A key of a Secret in the replay's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    /// The Secret's name.
    pub name: String,
    /// The key within the Secret's data.
    pub key: String,
}

/// The dead-letter queue.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SourceSpec {
    /// The queue's name. It must exist; the replay takes at most as many messages as it held
    /// when the replay started, so what dies again during the replay is not replayed by it.
    pub queue: String,
}

/// Overrides of the replay destination.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TargetSpec {
    /// Publish every replayed message to this exchange (`""` is the default exchange) instead of
    /// its original one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange: Option<String>,
    /// Publish with this routing key instead of the message's original one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_key: Option<String>,
}

/// The quarantine queue.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuarantineSpec {
    /// The queue's name; declared durable if it does not exist. Quarantined messages keep their
    /// body, properties and headers, plus `x-quarantine-reason` and `x-replay-id`.
    pub queue: String,
}

/// Which messages the replay takes. All given conditions must hold.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SelectorSpec {
    /// Take at most this many matching messages; the rest stay in the dead-letter queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// Only messages whose most recent death has one of these reasons (`rejected`, `expired`,
    /// `maxlen`, `delivery_limit`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub death_reasons: Vec<String>,
    /// Only messages that died in one of these queues (the `queue` of the most recent death).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub original_queues: Vec<String>,
    /// Only messages that carry each of these headers with exactly this value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Only messages whose JSON body matches each of these conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub payload: Vec<PayloadMatch>,
}

/// A condition on one field of a JSON body.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PayloadMatch {
    /// An RFC 6901 JSON pointer into the body, e.g. `/show` or `/asset/id`.
    pub pointer: String,
    /// The field equals this value (a string field by its text, any other by its JSON form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<String>,
    /// The field equals one of these values.
    #[serde(default, rename = "in", skip_serializing_if = "Option::is_none")]
    pub in_: Option<Vec<String>>,
}

/// The poison gate. A message that fails any check goes to quarantine, never to the target.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoisonSpec {
    /// Poison when the message died more often than this: the sum of its `x-death` counts plus
    /// its `x-replay-count` (which a replay sets, so a message that keeps coming back is caught
    /// even though replays strip `x-death`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_death_count: Option<u64>,
    /// JSON pointers that must be present in the body (which must then be JSON).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub required_fields: Vec<String>,
    /// JSON pointers whose value must be JSON: an object or array, or a string holding valid JSON.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub json_fields: Vec<String>,
    /// Stop before draining when more than this share (0 to 1) of the scanned messages is poison:
    /// the fix is probably not deployed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_quarantine_ratio: Option<f64>,
}

/// How the idempotency store decides that a message's work already happened.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum IdempotencyMode {
    /// Drop the message when the worker marked its key done (`GET key == doneValue`).
    #[default]
    Check,
    /// Claim the key (`SET key NX EX ttlSeconds`) before publishing; drop the message when the
    /// key is done or claimed already. No key is published twice, even across a crash.
    Claim,
}

/// The idempotency gate.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IdempotencySpec {
    /// The Redis that holds the keys the workers mark done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<ConnectionSpec>,
    /// `Check` (default) or `Claim`.
    #[serde(default)]
    pub mode: IdempotencyMode,
    /// How a message's key is derived from its JSON body.
    pub key: KeySpec,
    /// The value a worker writes under a key once the work is done.
    #[serde(default = "default_done_value")]
    pub done_value: String,
    /// The expiry of the claims written in `Claim` mode, in seconds.
    #[serde(default = "default_ttl_seconds")]
    pub ttl_seconds: u64,
}

fn default_done_value() -> String {
    "done".into()
}

fn default_ttl_seconds() -> u64 {
    604_800
}

/// The idempotency key: `prefix` + the first 32 hex characters of sha256 of the field values
/// joined by `:`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeySpec {
    /// The body fields that identify the work, in order. A missing field takes its default; a
    /// missing field without a default makes the message poison.
    pub fields: Vec<KeyField>,
    /// The prefix of every key.
    #[serde(default = "default_prefix")]
    pub prefix: String,
}

fn default_prefix() -> String {
    "idem:".into()
}

/// One field of the idempotency key.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeyField {
    /// An RFC 6901 JSON pointer into the body.
    pub pointer: String,
    /// The value used when the field is missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
}

/// Where the audit trail and replay state live.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuditSpec {
    /// The Redis that keeps the audit stream and the replay state.
    pub redis: ConnectionSpec,
}

/// A token bucket on replayed messages.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateSpec {
    /// Sustained replay rate, in messages per second (at least 1).
    pub messages_per_second: u32,
    /// How many messages may go at once after an idle moment. Defaults to `messagesPerSecond`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
}

/// The canary phase.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CanarySpec {
    /// Send one message per failure signature first and drain only the signatures whose canary
    /// did not come back.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// How long to watch for a canary's return, in seconds (5 to 1800). Make it longer than the
    /// consumer's retry chain.
    #[serde(default = "default_wait_seconds")]
    pub wait_seconds: u64,
    /// The header whose value names a message's failure signature. Messages without it are
    /// grouped by the reason and queue of their most recent death.
    #[serde(default = "default_signature_header")]
    pub signature_header: String,
    /// Further queues where a returning canary may land (besides the source queue).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub watch_queues: Vec<String>,
    /// Pre-flight: require at least one consumer on the target's queue.
    #[serde(default = "default_true")]
    pub require_consumer: bool,
    /// Pre-flight: the most messages the target's queue may hold before the replay starts.
    #[serde(default = "default_max_backlog")]
    pub max_backlog: u64,
    /// With `idempotency.mode: Check`: a canary passes only when the worker marks its key done
    /// within the wait.
    #[serde(default)]
    pub require_done: bool,
    /// While draining, stop when more than this share of the replayed messages came back.
    #[serde(default = "default_max_return_ratio")]
    pub max_return_ratio: f64,
    /// The most distinct failure signatures the queue may hold (1 to 1000). Each gets a canary
    /// and a line in the status; a header holding per-message text (an error message with ids in
    /// it) would make every message its own canary, so more than this fails the replay before
    /// anything is touched: choose a coarser `signatureHeader` or raise the limit.
    #[serde(default = "default_max_signatures")]
    pub max_signatures: u32,
}

impl Default for CanarySpec {
    fn default() -> Self {
        Self {
            enabled: true,
            wait_seconds: default_wait_seconds(),
            signature_header: default_signature_header(),
            watch_queues: Vec::new(),
            require_consumer: true,
            max_backlog: default_max_backlog(),
            require_done: false,
            max_return_ratio: default_max_return_ratio(),
            max_signatures: default_max_signatures(),
        }
    }
}

fn default_true() -> bool {
    true
}
fn default_wait_seconds() -> u64 {
    120
}
fn default_signature_header() -> String {
    "x-exception-type".into()
}
fn default_max_signatures() -> u32 {
    20
}
fn default_max_backlog() -> u64 {
    1000
}
fn default_max_return_ratio() -> f64 {
    0.05
}

/// Where a replay is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum Phase {
    /// Waiting for its pre-flight checks (credentials, queues, consumer, backlog).
    Pending,
    /// Canary messages are out; waiting to see whether they come back.
    Canary,
    /// Replaying the selected messages.
    Draining,
    /// Every selected message has its outcome.
    Done,
    /// Every canary came back: the fix does not hold. Nothing else was replayed.
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

/// The observed state of a replay.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DlqReplayStatus {
    /// Pending, Canary, Draining, Done, CanaryFailed, Failed or Suspended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// The id tagged on every replayed message as `x-replay-id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_id: Option<String>,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
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
    /// Where the audit trail is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditRef>,
    /// When the replay started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    /// When the replay reached a terminal phase (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// Standard conditions: Ready, Progressing, CanaryPassed, Degraded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// A one-line human summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
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
    /// The Redis stream that holds one row per decision.
    pub key: String,
    /// How many rows it holds.
    pub records: u64,
}

/// A standard Kubernetes condition.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// The condition's type, e.g. `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// A CamelCase reason.
    pub reason: String,
    /// A human-readable message.
    pub message: String,
    /// When the status last changed (RFC 3339).
    pub last_transition_time: String,
}

/// Spec fields that are fixed once a replay exists (everything but `suspend`): a replay is
/// reviewed as a whole, and changing what it replays mid-way would make its audit trail lie.
const IMMUTABLE_REQUIRED: [&str; 3] = ["broker", "source", "quarantine"];
const IMMUTABLE_OPTIONAL: [&str; 8] = [
    "target",
    "selector",
    "poison",
    "idempotency",
    "audit",
    "rate",
    "canary",
    "dryRun",
];

/// The CRD: the generated schema plus the CEL rule that makes the spec immutable except
/// `suspend`.
pub fn crd(
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::ValidationRule;
    use kube::CustomResourceExt;
    let mut crd = DlqReplay::crd();
    let rule = IMMUTABLE_REQUIRED
        .iter()
        .map(|f| format!("self.{f} == oldSelf.{f}"))
        .chain(IMMUTABLE_OPTIONAL.iter().map(|f| {
            format!(
                "has(self.{f}) == has(oldSelf.{f}) && (!has(self.{f}) || self.{f} == oldSelf.{f})"
            )
        }))
        .collect::<Vec<_>>()
        .join(" && ");
    for version in &mut crd.spec.versions {
        let spec = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .and_then(|s| s.properties.as_mut())
            .and_then(|p| p.get_mut("spec"));
        if let Some(spec) = spec {
            spec.x_kubernetes_validations = Some(vec![ValidationRule {
                rule: rule.clone(),
                message: Some("the spec of a DlqReplay is immutable except spec.suspend; create a new replay instead".into()),
                reason: Some("FieldValueForbidden".into()),
                ..Default::default()
            }]);
        }
    }
    crd
}
