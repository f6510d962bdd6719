//! What a replay is asked to do: the `spec` of a `DlqReplay`, the same for `kubectl apply` and
//! `dlq-replay run -f`.
//!
//! Doc comments on fields become the schema descriptions that `kubectl explain dlqreplay.spec...`
//! prints (the api crate puts this type's JSON schema into the CRD), so they are written for the
//! SRE reading them, not for the Rust reader. Bounds a schema keyword can say are said here
//! (`#[schemars(...)]`); the rules across fields are CEL rules in the api crate, and the command
//! line checks both through the CRD (the validate crate), so each rule is written once.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod expect;

pub use expect::{ExpectSpec, Published};

/// A replay of a RabbitMQ dead-letter queue: which messages to put back, where, how fast, and
/// which guards (poison gate, idempotency store, canary) stand in the way of a second failure.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
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
    /// What a reviewer approved: the failure signatures to replay and the most messages to
    /// replay and to quarantine. The replay never does more: a message of another signature
    /// stays in the dead-letter queue, and reaching a maximum stops the replay. `dlq-replay plan`
    /// prints the stanza that matches what the queue holds. Absent: no limit but the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<ExpectSpec>,
    /// Classify every message and report the counts, without publishing, acking, claiming or
    /// writing anything. The dead-letter queue is left exactly as it was.
    #[serde(default)]
    pub dry_run: bool,
    /// Wait for a person to approve the plan before anything moves. The operator plans the
    /// replay in the cluster (as `dlq-replay plan` does), writes the plan to `status.plan` with
    /// a digest of what the queue held, and waits in phase `AwaitingApproval` until the
    /// annotation `replay.dlq.dev/approve` carries that digest. It plans again then: when the
    /// queue changed, the approval is refused (an Event says so) and the new plan waits for its
    /// own. An approved plan is the most the replay does, as `spec.expect` would make it: its
    /// signatures, its counts of messages to replay and to quarantine. `dlq-replay run` asks for
    /// the digest with `--approve`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_approval: bool,
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
    /// `rediss://` use TLS. A clustered broker: its nodes separated by commas, as whole URLs or as
    /// hosts (`amqp://user:pass@node1:5672,node2:5672,node3:5672/vhost`); a lost node's replay
    /// goes on through the next. Redis behind Sentinel:
    /// `redis+sentinel://sentinel1:26379,sentinel2:26379/<master name>`; a Redis Cluster:
    /// `redis+cluster://node1:6379,node2:6379`; `?replicas=N` says how many replicas must hold
    /// a claim or an outcome before the replay relies on it (1 by default with Sentinel or
    /// Cluster, 0 for one server). Prefer `urlSecretRef` for anything but local runs.
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
    /// With the canary: stop before anything moves when more than this share (0 to 1) of the
    /// messages in the canary's first look-ahead (`canary.lookAhead`, or the whole queue when it is
    /// shorter) is poison: the fix is probably not deployed.
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
    /// Where the audit rows go: `Redis` (default: a stream in the replay's Redis, about 80 bytes
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

pub(crate) fn is_default<T: Default + PartialEq>(v: &T) -> bool {
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
    /// The most distinct failure signatures the replay may meet (1 to 1000). Each gets a canary
    /// and a line in the status; a header holding per-message text (an error message with ids in
    /// it) would make every message its own canary. More than this within the first look-ahead
    /// fails the replay before anything moves; met later in the drain, it stops the replay there
    /// (`Failed`, what is not replayed stays in the queue): choose a coarser `signatureHeader`
    /// or raise the limit.
    #[serde(default = "default_max_signatures")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_signatures: u32,
    /// The most messages set aside (held by the replay, unacknowledged, in the order they came)
    /// while the canary of their signature is out (1 to 10000). Signatures are discovered as the
    /// drain meets them: the first message of a new signature is its canary, the messages of
    /// proven signatures drain at once, and those of a signature still waiting are set aside;
    /// with this many set aside, the drain waits for the canaries instead of reading further.
    /// The replay starts by reading this many (the first look-ahead) before anything moves, and
    /// every signature met there has its canary out together. Costs memory (the messages'
    /// bodies) and consumer prefetch; nothing is published to set a message aside.
    #[serde(default = "default_look_ahead")]
    #[schemars(range(min = 1, max = 10000))]
    pub look_ahead: u32,
    /// What a canary that came back (or, with `requireDone`, was not confirmed) does to the rest:
    /// `HoldSignature` (default) leaves its signature's messages in the queue and drains the
    /// proven signatures; when no signature passed and none is still waiting, the replay ends
    /// `CanaryFailed`. `StopReplay` ends the replay `CanaryFailed` at once: what proven
    /// signatures replayed before stays replayed, the rest stays in the queue.
    #[serde(default, skip_serializing_if = "is_default")]
    pub on_failure: CanaryFailure,
}

/// What a failed canary does to the other signatures (`canary.onFailure`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum CanaryFailure {
    /// Hold only the failed canary's signature; drain the proven ones.
    #[default]
    HoldSignature,
    /// Stop the replay (`CanaryFailed`).
    StopReplay,
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
            look_ahead: default_look_ahead(),
            on_failure: CanaryFailure::default(),
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
fn default_look_ahead() -> u32 {
    1000
}
fn default_max_backlog() -> u64 {
    1000
}
fn default_max_return_ratio() -> f64 {
    0.05
}
