//! The `DlqReplay` custom resource: the engine's spec as a Kubernetes object, its status with
//! what only a cluster has (conditions, the generation observed, the retry annotation acted on),
//! its CEL rules and the CRD they are written into.
//!
//! The spec's types and doc comments live in the engine ([`dlq_replay_engine::spec`]), which
//! the command line runs without a cluster; this crate wraps them, so `kubectl explain` and
//! `dlq-replay run -f` read the same fields.

use std::ops::{Deref, DerefMut};

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod rules;

pub use dlq_replay_engine::spec::*;
pub use dlq_replay_engine::status::*;
pub use rules::*;

/// The API group of the resource.
pub const GROUP: &str = "replay.dlq.dev";
/// The `apiVersion` a manifest must carry.
pub const API_VERSION: &str = "replay.dlq.dev/v1alpha1";
/// The `kind` a manifest must carry.
pub const KIND: &str = "DlqReplay";
/// The annotation that retries a `Failed` or `CanaryFailed` replay in place: set it to a value
/// that `status.retriedFor` does not hold yet (e.g. a timestamp).
pub const RETRY_ANNOTATION: &str = "replay.dlq.dev/retry";
/// The annotation that approves a replay's plan (`spec.requireApproval`): set it to
/// `status.plan.digest`, the plan a person read and approves.
pub const APPROVE_ANNOTATION: &str = "replay.dlq.dev/approve";

// The `spec` of a `DlqReplay`: the engine's `DlqReplaySpec`, unchanged on the wire and in the
// schema (transparent: the schema's description is the engine type's doc comment, so this one is
// a plain comment), so the resource and a manifest for `dlq-replay run` are one format.
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
    printcolumn = r#"{"name":"Plan","type":"string","jsonPath":".status.plan.digest"}"#,
    printcolumn = r#"{"name":"To Replay","type":"integer","priority":1,"jsonPath":".status.plan.counts.replayed"}"#,
    printcolumn = r#"{"name":"Replayed","type":"integer","jsonPath":".status.counts.replayed"}"#,
    printcolumn = r#"{"name":"Duplicates","type":"integer","jsonPath":".status.counts.duplicates"}"#,
    printcolumn = r#"{"name":"Quarantined","type":"integer","jsonPath":".status.counts.quarantined"}"#,
    printcolumn = r#"{"name":"Failed","type":"integer","jsonPath":".status.counts.failed"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.message"}"#
)]
#[serde(transparent)]
#[schemars(transparent)]
pub struct ResourceSpec(pub DlqReplaySpec);

impl Deref for ResourceSpec {
    type Target = DlqReplaySpec;
    fn deref(&self) -> &DlqReplaySpec {
        &self.0
    }
}

impl DerefMut for ResourceSpec {
    fn deref_mut(&mut self) -> &mut DlqReplaySpec {
        &mut self.0
    }
}

impl From<DlqReplaySpec> for ResourceSpec {
    fn from(spec: DlqReplaySpec) -> Self {
        Self(spec)
    }
}

// The engine's `ReplayStatus` (flattened: its fields sit at the top of `status`) and what the
// operator adds to it. The doc comment below is the schema's description.
/// The observed state of a replay.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DlqReplayStatus {
    /// What the engine reports.
    #[serde(flatten)]
    pub replay: ReplayStatus,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Standard conditions (`metav1.Condition`), each with the `observedGeneration` it was set
    /// for: `Ready` (True once Done), `Reconciling` (True in Pending, AwaitingApproval, Canary
    /// and Draining) and
    /// `Stalled` (True in Failed and CanaryFailed), as kstatus (Flux, `kubectl wait`) reads them;
    /// also `Progressing` (True in Canary and Draining) and `Degraded` (True in Failed and
    /// CanaryFailed). A Suspended replay has none True. Their reason is the CamelCase word that
    /// starts `message` (e.g. `SourceBusy`, `OperatorStopped`, `InvalidSpec`), else the phase.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    /// The value of the `replay.dlq.dev/retry` annotation the operator last acted on (or found
    /// when the replay started). Setting the annotation to any other value retries a Failed or
    /// CanaryFailed replay in place, under the same replay id (a CanaryFailed one with new
    /// canaries); a Done replay, or one Failed with reason InvalidSpec, is not retried (an Event
    /// says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried_for: Option<String>,
    /// With `spec.requireApproval`: the plan the operator made in the cluster, which waits for
    /// approval (or was approved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanStatus>,
    /// The digest of the plan that was approved: the replay runs within that plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_digest: Option<String>,
    /// The last `replay.dlq.dev/approve` value the operator refused (an older plan's digest):
    /// not acted on again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_refused_for: Option<String>,
}

/// A plan made in the cluster for approval (`status.plan`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlanStatus {
    /// What the approval annotation must carry: a hash of the messages the plan read and of
    /// its decisions (`sha256:` and 32 hex digits).
    pub digest: String,
    /// When the plan was made (RFC 3339).
    pub planned_at: String,
    /// Messages in the dead-letter queue when it was made.
    pub depth: u64,
    /// What the replay would do (`replayed`: would replay).
    pub counts: Counts,
    /// The same per failure signature.
    #[serde(default)]
    pub by_signature: std::collections::BTreeMap<String, Counts>,
}

// The status reads as the engine's with more fields: `status.phase`, `status.counts`.
impl Deref for DlqReplayStatus {
    type Target = ReplayStatus;
    fn deref(&self) -> &ReplayStatus {
        &self.replay
    }
}

impl DerefMut for DlqReplayStatus {
    fn deref_mut(&mut self) -> &mut ReplayStatus {
        &mut self.replay
    }
}

impl From<ReplayStatus> for DlqReplayStatus {
    fn from(replay: ReplayStatus) -> Self {
        Self {
            replay,
            ..Default::default()
        }
    }
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
