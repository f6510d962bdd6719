//! The test kit: real dead letters on a real broker for the demo, the tests and the benchmark,
//! and, behind features, what only the tests (and `make faults`) use.
//!
//! - [`fixture`] (the `dlq-replay-fixture` crate, re-exported here): the topology and dead
//!   letters as RabbitMQ makes them. The shipped binary's demo uses that crate directly
//!   (`dlq_replay::fixture`), so an edit here rebuilds the tests and not the binary.
//! - `world` (feature `world`): one test's world on a real broker and Redis ([`world::World`]),
//!   the broker × queue-type matrix ([`world::Target`], the [`matrix!`] macro).
//! - `faults` (feature `world`): the fault suite's scenarios (`tests/faults.rs`, `make faults`).
//! - `ha` (feature `world`): the clustered servers (a three-node RabbitMQ, Redis Sentinel, Redis
//!   Cluster) the node-loss scenarios and the store's cluster tests run on.
//! - `fake_api` and `cluster` (feature `fake-api`): the in-process fake Kubernetes API server, and
//!   where a controller scenario runs (the fake, or a real cluster with `E2E=1`).
//!
//! The root package depends on this crate in its `[dev-dependencies]` only, with both features.

pub use dlq_replay_fixture as fixture;
pub use dlq_replay_fixture::*;

#[cfg(feature = "fake-api")]
pub mod cluster;
#[cfg(feature = "fake-api")]
pub mod fake_api;
#[cfg(feature = "world")]
pub mod faults;
#[cfg(feature = "world")]
pub mod ha;
#[cfg(feature = "world")]
pub mod world;
