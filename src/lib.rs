//! dlq-replay: replay dead-lettered RabbitMQ messages safely and declaratively.
//!
//! - [`api`]: the `DlqReplay` resource (spec and status), shared by the CLI and the operator.
//! - [`manifest`]: reading and validating a manifest.
//! - [`engine`]: the replay itself, free of Kubernetes.
//! - [`cli`]: the `dlq-replay` command line.

pub mod api;
pub mod cli;
pub mod controller;
pub mod demo;
pub mod engine;
pub mod fixture;
pub mod manifest;
pub mod metrics;
pub mod redact;
pub mod telemetry;

/// What can go wrong outside a single message's decision.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The manifest is invalid.
    #[error("{0}")]
    Manifest(String),
    /// A file could not be read or written.
    #[error("{0}")]
    Io(String),
    /// Missing configuration, e.g. no broker URL.
    #[error("{0}")]
    Config(String),
    /// The source queue does not exist.
    #[error("source queue {0:?} does not exist (spec.source.queue); nothing was touched")]
    SourceMissing(String),
    /// The broker failed.
    #[error("broker: {0}")]
    Broker(String),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(String),
}

impl From<lapin::Error> for Error {
    fn from(e: lapin::Error) -> Self {
        Error::Broker(e.to_string())
    }
}

impl From<redis::ParsingError> for Error {
    fn from(e: redis::ParsingError) -> Self {
        Error::Redis(e.to_string())
    }
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::Redis(e.to_string())
    }
}
