//! The operations kit: `deploy/monitoring` (ServiceMonitor, PrometheusRule, Grafana dashboard)
//! and `deploy/gitops` (the Argo CD health check).
//!
//! - Every metric name an alert or a dashboard query reads is one the operator exports: the
//!   exported names come from the operator's own registry (`Metrics::new()`, each family touched,
//!   served by its `/metrics` route), not from a list written here.
//! - The alerts' promtool unit tests (`deploy/monitoring/tests/rules.test.yaml`) pass, when
//!   `promtool` is on PATH (else SKIPPED, said on stderr; a failure when REQUIRE_PROMTOOL is set,
//!   as `.ci/run` does).
//! - `kubectl kustomize` renders the component alone and added to `deploy/` (SKIPPED without
//!   kubectl).
//! - The Argo CD health check (`deploy/gitops/health.lua`), run in Lua 5.1 (Argo CD's
//!   gopher-lua speaks 5.1), maps a status of
//!   every phase of `api::Phase` (taken from the type, so a new phase without a mapping fails),
//!   a missing status and a status older than the spec; the argocd-cm example holds it verbatim.
//!
//! By part of the kit: [`queries`], [`monitoring`], [`argo`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use dlq_replay::api::{CanaryResult, CanaryStatus, Counts, DlqReplayStatus, Phase, ReplayStatus};
use dlq_replay::metrics::Metrics;
use mlua::LuaSerdeExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod argo;
mod monitoring;
mod queries;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn rules() -> serde_yaml::Value {
    serde_yaml::from_str(&read("deploy/monitoring/prometheusrule.yaml")).expect("YAML")
}
