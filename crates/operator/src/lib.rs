//! The operator: it watches `DlqReplay` resources and runs each one's replay with the engine,
//! one leader at a time.
//!
//! - [`controller`]: leader election, reconcile and `error_policy`, the replay's task, status
//!   writes and Events, URLs from Secrets.
//! - [`metrics`]: the Prometheus metrics (fed by the controller and, through
//!   [`dlq_replay_engine::observe`], by the engine) and the `/metrics`, `/healthz`, `/readyz`
//!   endpoints.

pub mod controller;
pub mod metrics;

pub(crate) use dlq_replay_api as api;
pub(crate) use dlq_replay_engine as engine;
pub(crate) use dlq_replay_engine::redact;
pub(crate) use dlq_replay_validate as manifest;
