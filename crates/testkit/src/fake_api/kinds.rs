//! The resource types the fake serves, and how a request names an object.

/// A resource type the fake serves.
#[derive(Debug, Clone, Copy)]
pub(super) struct Kind {
    pub(super) group: &'static str,
    pub(super) version: &'static str,
    pub(super) plural: &'static str,
    pub(super) kind: &'static str,
    pub(super) namespaced: bool,
    /// Has a `/status` subresource: the main resource cannot write `.status` and vice versa.
    pub(super) status: bool,
}

impl Kind {
    pub(super) const fn new(
        group: &'static str,
        version: &'static str,
        plural: &'static str,
        kind: &'static str,
        namespaced: bool,
        status: bool,
    ) -> Self {
        Self {
            group,
            version,
            plural,
            kind,
            namespaced,
            status,
        }
    }

    pub(super) fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `dlqreplays.replay.dlq.dev` or `secrets`, as real error messages name a resource.
    pub(super) fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    pub(super) fn is_event(&self) -> bool {
        self.plural == "events"
    }

    /// A custom resource (served through a CRD) rather than a built-in one.
    pub(super) fn is_custom(&self) -> bool {
        !(self.group.is_empty() || self.group.ends_with(".k8s.io") || !self.group.contains('.'))
    }

    /// Checked against its CRD's structural schema: the `DlqReplay`.
    pub(super) fn has_schema(&self) -> bool {
        self.group == dlq_replay_api::GROUP && self.plural == "dlqreplays"
    }

    /// The name of the CRD that serves this kind, `dlqreplays.replay.dlq.dev`.
    pub(super) fn crd_name(&self) -> String {
        format!("{}.{}", self.plural, self.group)
    }
}

pub(super) const KINDS: &[Kind] = &[
    Kind::new(
        "replay.dlq.dev",
        "v1alpha1",
        "dlqreplays",
        "DlqReplay",
        true,
        true,
    ),
    Kind::new("", "v1", "secrets", "Secret", true, false),
    Kind::new("", "v1", "configmaps", "ConfigMap", true, false),
    Kind::new("", "v1", "events", "Event", true, false),
    Kind::new("events.k8s.io", "v1", "events", "Event", true, false),
    Kind::new("coordination.k8s.io", "v1", "leases", "Lease", true, false),
    Kind::new("", "v1", "pods", "Pod", true, true),
    Kind::new("", "v1", "services", "Service", true, true),
    Kind::new("", "v1", "serviceaccounts", "ServiceAccount", true, false),
    Kind::new("", "v1", "namespaces", "Namespace", false, true),
    Kind::new("batch", "v1", "jobs", "Job", true, true),
    Kind::new("apps", "v1", "deployments", "Deployment", true, true),
    Kind::new(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        false,
        true,
    ),
];

pub(super) fn kind_index(group: &str, version: &str, plural: &str) -> Option<usize> {
    KINDS
        .iter()
        .position(|k| k.group == group && k.version == version && k.plural == plural)
}

/// (kind index, namespace or "" for cluster-scoped, name)
pub(super) type Key = (usize, String, String);
