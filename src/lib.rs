//! dlq-replay: replay dead-lettered RabbitMQ messages safely and declaratively.
//!
//! This package is the `dlq-replay` binary: the command line ([`cli`], with the demo as its
//! child), the incident report ([`report`]) and logging ([`telemetry`]). The replay itself and
//! the operator are crates of the workspace, re-exported here under the names the command line,
//! the tests and the benches use:
//!
//! - [`engine`] (`dlq-replay-engine`): the replay, free of Kubernetes;
//! - [`api`] (`dlq-replay-api`): the `DlqReplay` resource, its CEL rules and CRD;
//! - [`manifest`] (`dlq-replay-validate`): a manifest checked as kube-apiserver checks it;
//! - [`controller`] and [`metrics`] (`dlq-replay-operator`): the operator;
//! - [`fixture`] (`dlq-replay-fixture`): dead letters as RabbitMQ makes them (demo, tests).
//!
//! [`plugin`] is the kubectl plugin (`kubectl dlqreplay`, the binary `kubectl-dlqreplay`).

pub mod cli;
pub mod plugin;
pub mod report;
pub mod telemetry;

pub use dlq_replay_api as api;
pub use dlq_replay_engine as engine;
pub use dlq_replay_engine::{redact, tls, Error};
pub use dlq_replay_fixture as fixture;
pub use dlq_replay_operator::{controller, metrics};
pub use dlq_replay_validate as manifest;
