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
/// The annotation that retries a `Failed` or `CanaryFailed` replay in place: set it to a value
/// that `status.retriedFor` does not hold yet (e.g. a timestamp).
pub const RETRY_ANNOTATION: &str = "replay.dlq.dev/retry";

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
    /// Where the audit trail and the replay's own state are kept (the idempotency store's Redis
    /// when that is set), and for how long (`retentionSeconds`, 30 days by default).
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
/// namespace; exactly one of the two. On the command line, `--amqp-url` and `--redis-url` stand in
/// for the Secret.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConnectionSpec {
    /// The URL, e.g. `amqp://user:pass@host:5672/vhost` or `redis://host:6379/0`; `amqps://` and
    /// `rediss://` use TLS. Prefer `urlSecretRef` for anything but local runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
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
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key within the Secret's data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// The dead-letter queue.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SourceSpec {
    /// The queue's name. It must exist; the replay takes at most as many messages as it held
    /// when the replay started, so what dies again during the replay is not replayed by it.
    #[schemars(length(min = 1, max = 255))]
    pub queue: String,
}

/// Overrides of the replay destination.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TargetSpec {
    /// Publish every replayed message to this exchange (`""` is the default exchange) instead of
    /// its original one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 255))]
    pub exchange: Option<String>,
    /// Publish with this routing key instead of the message's original one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 255))]
    pub routing_key: Option<String>,
}

/// The quarantine queue.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuarantineSpec {
    /// The queue's name; declared durable if it does not exist. Quarantined messages keep their
    /// body, properties and headers, plus `x-quarantine-reason` and `x-replay-id`. It must differ
    /// from the source queue.
    #[schemars(length(min = 1, max = 255))]
    pub queue: String,
}

/// Which messages the replay takes. All given conditions must hold.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SelectorSpec {
    /// Take at most this many matching messages (at least 1); the rest stay in the dead-letter
    /// queue. Absent: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub limit: Option<u64>,
    /// Only messages whose most recent death has one of these reasons (`rejected`, `expired`,
    /// `maxlen`, `delivery_limit`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4), transform = death_reason_items)]
    pub death_reasons: Vec<String>,
    /// Only messages that died in one of these queues (the `queue` of the most recent death).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 255)))]
    pub original_queues: Vec<String>,
    /// Only messages that carry each of these headers with exactly this value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Only messages whose JSON body matches each of these conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub payload: Vec<PayloadMatch>,
}

/// The reasons RabbitMQ records in `x-death`.
pub const DEATH_REASONS: [&str; 4] = ["rejected", "expired", "maxlen", "delivery_limit"];

/// `selector.deathReasons` takes only the reasons RabbitMQ records: a typo would select nothing.
fn death_reason_items(schema: &mut schemars::Schema) {
    if let Some(items) = schema.get_mut("items").and_then(|i| i.as_object_mut()) {
        items.insert("enum".into(), serde_json::json!(DEATH_REASONS));
    }
}

/// An RFC 6901 JSON pointer to a field (not the whole body): `/`, then `~0` for `~` and `~1` for
/// `/` in a name. The pattern of every pointer field in the schema.
pub const JSON_POINTER: &str = "^/([^~]|~[01])*$";

/// A condition on one field of a JSON body.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PayloadMatch {
    /// An RFC 6901 JSON pointer into the body, e.g. `/show` or `/asset/id`.
    #[schemars(length(max = 1024), regex(pattern = JSON_POINTER))]
    pub pointer: String,
    /// The field equals this value (a string field by its text, any other by its JSON form).
    /// One of `equals` and `in` is required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<String>,
    /// The field equals one of these values (at least one).
    #[serde(default, rename = "in", skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
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
    #[schemars(length(max = 64), inner(length(max = 1024), regex(pattern = JSON_POINTER)))]
    pub required_fields: Vec<String>,
    /// JSON pointers whose value must be JSON: an object or array, or a string holding valid JSON.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 1024), regex(pattern = JSON_POINTER)))]
    pub json_fields: Vec<String>,
    /// Stop before draining when more than this share (0 to 1) of the scanned messages is poison:
    /// the fix is probably not deployed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
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
    /// The value a worker writes under a key once the work is done (not empty).
    #[serde(default = "default_done_value")]
    #[schemars(length(min = 1))]
    pub done_value: String,
    /// The expiry of the claims written in `Claim` mode, in seconds (at least 1).
    #[serde(default = "default_ttl_seconds")]
    #[schemars(range(min = 1))]
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
    /// The body fields that identify the work, in order (1 to 32). A missing field takes its
    /// default; a missing field without a default makes the message poison.
    #[schemars(length(min = 1, max = 32))]
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
    /// An RFC 6901 JSON pointer into the body, e.g. `/asset/id`.
    #[schemars(length(max = 1024), regex(pattern = JSON_POINTER))]
    pub pointer: String,
    /// The value used when the field is missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
}

/// Where the audit trail and replay state live, and for how long.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuditSpec {
    /// The Redis that keeps the audit stream and the replay state when there is no
    /// `spec.idempotency.redis` (which keeps them when set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<ConnectionSpec>,
    /// How long the replay's Redis keys (its state, its settled marks and its audit stream) are
    /// kept after it stops, in seconds (3600 to 315360000; default 2592000, 30 days). While it
    /// runs (waits included) or is suspended, their expiry is set again at least every 10
    /// minutes, so it never loses its state; once it ends (Done, CanaryFailed, Failed) or stops,
    /// they expire this long after. Resumed or retried within that time it keeps its replay id;
    /// later it starts over under a new one. Export the audit trail (`dlq-replay audit`) if it
    /// must be kept longer.
    #[serde(default = "default_retention_seconds")]
    #[schemars(range(min = 3600, max = 315_360_000))]
    pub retention_seconds: u64,
    /// Where the audit rows go: `Redis` (default: a stream in the replay's Redis, about 90 bytes
    /// a row, read back by `dlq-replay audit` and `report`) or `Log` (one JSON line per row,
    /// marked `"audit":"dlq-replay"`, on the operator's (or `dlq-replay run`'s) standard error,
    /// which the cluster's log collector keeps; Redis then keeps only the replay's state and
    /// counts; `dlq-replay audit --log FILE` and `report --log FILE` read the lines back). Either
    /// way a row is written before its message is acked.
    #[serde(default, skip_serializing_if = "is_default")]
    pub sink: AuditSink,
    /// Run even though the replay's Redis may evict keys. Before anything moves, a replay reads
    /// the Redis's `maxmemory-policy` and room (`INFO memory`, which managed Redis services
    /// allow where they refuse `CONFIG`) and refuses to start when a policy that evicts any key
    /// (`allkeys-*`) is set, or when `maxmemory` leaves less room than the replay is expected to
    /// write at its peak: the replay's own writes could then evict the workers' done marks, and a
    /// later replay would republish work that already happened. `true` accepts that risk;
    /// `status.redisEvictionRisk` and the report say so.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accept_redis_eviction: bool,
}

/// Where a replay's audit rows go (`spec.audit.sink`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum AuditSink {
    /// A Redis stream beside the replay's state.
    #[default]
    Redis,
    /// JSON lines on standard error (the log stream).
    Log,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// 30 days.
pub const DEFAULT_RETENTION_SECONDS: u64 = 2_592_000;

fn default_retention_seconds() -> u64 {
    DEFAULT_RETENTION_SECONDS
}

impl DlqReplaySpec {
    /// How long the replay's Redis keys are kept ([`AuditSpec::retention_seconds`]).
    pub fn retention_seconds(&self) -> u64 {
        self.audit
            .as_ref()
            .map_or(DEFAULT_RETENTION_SECONDS, |a| a.retention_seconds)
    }

    /// Where the audit rows go ([`AuditSpec::sink`]).
    pub fn audit_sink(&self) -> AuditSink {
        self.audit.as_ref().map_or(AuditSink::Redis, |a| a.sink)
    }

    /// Whether the risk of an evicting Redis is accepted ([`AuditSpec::accept_redis_eviction`]).
    pub fn accepts_redis_eviction(&self) -> bool {
        self.audit.as_ref().is_some_and(|a| a.accept_redis_eviction)
    }
}

/// A token bucket on replayed messages.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateSpec {
    /// Sustained replay rate, in messages per second (at least 1; omit `rate` for no limit).
    #[schemars(range(min = 1))]
    pub messages_per_second: u32,
    /// How many messages may go at once after an idle moment (at least 1). Defaults to a
    /// twentieth of `messagesPerSecond`, at least 1, so no second sees much more than the rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
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
    #[schemars(range(min = 5, max = 1800))]
    pub wait_seconds: u64,
    /// The header whose value names a message's failure signature. Messages without it are
    /// grouped by the reason and queue of their most recent death.
    #[serde(default = "default_signature_header")]
    #[schemars(length(min = 1, max = 255))]
    pub signature_header: String,
    /// Further queues where a returning canary may land (besides the source queue).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 255)))]
    pub watch_queues: Vec<String>,
    /// Pre-flight: require at least one consumer on the target's queue.
    #[serde(default = "default_true")]
    pub require_consumer: bool,
    /// Pre-flight: the most messages the target's queue may hold before the replay starts.
    #[serde(default = "default_max_backlog")]
    pub max_backlog: u64,
    /// With `idempotency.mode: Check` (required): a canary passes only when the worker marks its
    /// key done within the wait.
    #[serde(default)]
    pub require_done: bool,
    /// While draining, stop when more than this share (0 to 1) of the replayed messages came back.
    #[serde(default = "default_max_return_ratio")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_return_ratio: f64,
    /// The most distinct failure signatures the queue may hold (1 to 1000). Each gets a canary
    /// and a line in the status; a header holding per-message text (an error message with ids in
    /// it) would make every message its own canary, so more than this fails the replay before
    /// anything is touched: choose a coarser `signatureHeader` or raise the limit.
    #[serde(default = "default_max_signatures")]
    #[schemars(range(min = 1, max = 1000))]
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
    /// Standard conditions (`metav1.Condition`), each with the `observedGeneration` it was set
    /// for: `Ready` (True once Done), `Reconciling` (True in Pending, Canary and Draining) and
    /// `Stalled` (True in Failed and CanaryFailed), as kstatus (Flux, `kubectl wait`) reads them;
    /// also `Progressing` (True in Canary and Draining) and `Degraded` (True in Failed and
    /// CanaryFailed). A Suspended replay has none True. Their reason is the CamelCase word that
    /// starts `message` (e.g. `SourceBusy`, `OperatorStopped`, `InvalidSpec`), else the phase.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    /// A one-line human summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The value of the `replay.dlq.dev/retry` annotation the operator last acted on (or found
    /// when the replay started). Setting the annotation to any other value retries a Failed or
    /// CanaryFailed replay in place, under the same replay id (a CanaryFailed one with new
    /// canaries); a Done replay, or one Failed with reason InvalidSpec, is not retried (an Event
    /// says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried_for: Option<String>,
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

impl DlqReplay {
    /// The replay's namespace, `default` for a manifest that names none (as `kubectl apply`
    /// would place it).
    pub fn namespace_or_default(&self) -> String {
        self.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into())
    }

    /// The replay's name (empty when the manifest names none; the manifest check refuses that).
    pub fn name_or_empty(&self) -> String {
        self.metadata.name.clone().unwrap_or_default()
    }
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

/// The URL schemes of the broker.
pub const AMQP_SCHEMES: [&str; 2] = ["amqp", "amqps"];
/// The URL schemes of Redis.
pub const REDIS_SCHEMES: [&str; 2] = ["redis", "rediss"];

/// One CEL rule of the CRD (an entry of `x-kubernetes-validations`).
///
/// [`rules`] is the one list of the checks a schema keyword cannot express (cross-field rules,
/// URLs, immutability). [`crd`] puts each on its schema node, so `kubectl apply` refuses a spec
/// that breaks one, and the command line (`manifest::validate_spec`) evaluates the same rules
/// from that same schema: they are written here only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The schema node the rule sits on and `self` is bound to: `spec`, `spec.broker`, ...;
    /// `name[]` stands for each item of the list `name` (`spec.selector.payload[]`).
    pub at: &'static str,
    /// The CEL expression: true when the value is valid. A rule that reads `oldSelf` is a
    /// transition rule, evaluated only on updates.
    pub rule: String,
    /// The field an error names, relative to `at` (`.url`); `None`: `at` itself.
    pub field_path: Option<String>,
    /// What the error says about that field.
    pub message: String,
    /// The error's reason: `FieldValueForbidden` for the immutable fields; `None` means
    /// `FieldValueInvalid`.
    pub reason: Option<&'static str>,
}

impl Rule {
    fn new(at: &'static str, rule: &str, field_path: Option<&str>, message: &str) -> Self {
        Self {
            at,
            rule: rule.into(),
            field_path: field_path.map(str::to_string),
            message: message.into(),
            reason: None,
        }
    }

    /// The field an error of this rule names, e.g. `spec.broker.url` (`[*]` for a list item).
    pub fn field(&self) -> String {
        format!(
            "{}{}",
            self.at.replace("[]", "[*]"),
            self.field_path.as_deref().unwrap_or("")
        )
    }

    /// Whether the rule compares with the stored object (`oldSelf`): evaluated on updates only.
    pub fn is_transition(&self) -> bool {
        self.rule.contains("oldSelf")
    }
}

/// The rule a connection's inline `url` must pass, as a CEL expression on `self.url` (true when
/// `url` is absent), with its message: a URL (Kubernetes' `isURL`) with one of `schemes`, a host,
/// and a port up to 65535. The message never repeats the URL (it may hold a password).
pub fn url_rule(schemes: &[&str]) -> (String, String) {
    let list = schemes
        .iter()
        .map(|s| format!("'{s}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let u = "url(self.url)";
    let rule = format!(
        "!has(self.url) || (isURL(self.url) && {u}.getScheme() in [{list}] && {u}.getHostname() != '' && ({u}.getPort() == '' || int({u}.getPort()) <= 65535))"
    );
    let message = format!(
        "must be a URL with scheme {} and a host (port at most 65535), e.g. {}://user:pass@host:port/...",
        schemes.join(" or "),
        schemes[0]
    );
    (rule, message)
}

/// Every CEL rule of the CRD. The bounds of single fields (at least 1, 5 to 1800, not empty, a
/// JSON pointer, ...) are schema keywords on the fields above (`#[schemars(...)]`); these are
/// the rest.
pub fn rules() -> Vec<Rule> {
    let mut rules = vec![
        Rule::new(
            "spec",
            "self.quarantine.queue != self.source.queue",
            Some(".quarantine.queue"),
            "must differ from spec.source.queue",
        ),
        Rule::new(
            "spec",
            "!has(self.canary) || !has(self.canary.requireDone) || !self.canary.requireDone || (has(self.idempotency) && (!has(self.idempotency.mode) || self.idempotency.mode == 'Check'))",
            Some(".canary.requireDone"),
            "needs spec.idempotency.mode: Check",
        ),
        // `in` is a CEL keyword: Kubernetes escapes the field's name to `__in__`.
        Rule::new(
            "spec.selector.payload[]",
            "has(self.equals) || has(self.__in__)",
            None,
            "needs `equals` or `in`",
        ),
    ];
    for (at, schemes) in [
        ("spec.broker", &AMQP_SCHEMES),
        ("spec.idempotency.redis", &REDIS_SCHEMES),
        ("spec.audit.redis", &REDIS_SCHEMES),
    ] {
        rules.push(Rule::new(
            at,
            "has(self.url) != has(self.urlSecretRef)",
            None,
            "give exactly one of url and urlSecretRef",
        ));
        let (rule, message) = url_rule(schemes);
        rules.push(Rule {
            at,
            rule,
            field_path: Some(".url".into()),
            message,
            reason: None,
        });
    }
    let immutable = |field: &str, rule: String| {
        Rule {
        at: "spec",
        rule,
        field_path: Some(format!(".{field}")),
        message: "is immutable: the spec of a DlqReplay is fixed except spec.suspend; create a new replay instead".into(),
        reason: Some("FieldValueForbidden"),
    }
    };
    for f in IMMUTABLE_REQUIRED {
        rules.push(immutable(f, format!("self.{f} == oldSelf.{f}")));
    }
    for f in IMMUTABLE_OPTIONAL {
        rules.push(immutable(
            f,
            format!(
                "has(self.{f}) == has(oldSelf.{f}) && (!has(self.{f}) || self.{f} == oldSelf.{f})"
            ),
        ));
    }
    rules
}

/// The CRD: the schema the types derive (with the bounds of their fields), plus the CEL rules
/// of [`rules`] on their nodes.
pub fn crd(
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::ValidationRule;
    use kube::CustomResourceExt;
    let mut crd = DlqReplay::crd();
    let rules = rules();
    for version in &mut crd.spec.versions {
        let Some(root) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        else {
            continue;
        };
        for r in &rules {
            let node = schema_node(root, r.at)
                .unwrap_or_else(|| panic!("api::rules(): no schema node {}", r.at));
            node.x_kubernetes_validations
                .get_or_insert_with(Vec::new)
                .push(ValidationRule {
                    rule: r.rule.clone(),
                    message: Some(r.message.clone()),
                    reason: r.reason.map(str::to_string),
                    field_path: r.field_path.clone(),
                    ..Default::default()
                });
        }
    }
    crd
}

/// The schema node at `at` (see [`Rule::at`]).
fn schema_node<'a>(
    root: &'a mut k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps,
    at: &str,
) -> Option<
    &'a mut k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps,
> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray;
    at.split('.').try_fold(root, |node, segment| {
        let (name, each) = match segment.strip_suffix("[]") {
            Some(name) => (name, true),
            None => (segment, false),
        };
        let child = node.properties.as_mut()?.get_mut(name)?;
        if !each {
            return Some(child);
        }
        match child.items.as_mut()? {
            JSONSchemaPropsOrArray::Schema(item) => Some(&mut **item),
            JSONSchemaPropsOrArray::Schemas(_) => None,
        }
    })
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
