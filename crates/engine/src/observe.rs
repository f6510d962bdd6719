//! What the engine tells whoever watches it from outside (the operator's Prometheus metrics):
//! retries, confirm latencies, and the invariant Claim mode exists for, if it ever breaks.
//!
//! A trait and not the metrics themselves, so the engine does not carry an HTTP server or a
//! metrics registry: the operator installs its metrics once ([`install`]); the CLI without
//! `--metrics-port` installs nothing and the calls cost a load of a pointer.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A listener to the engine's events. Every method has a default that does nothing.
pub trait Observer: Send + Sync {
    /// A call to the broker or Redis is tried again (`what` names it, e.g. `reconnect`).
    fn retried(&self, _what: &str) {}
    /// A publish was confirmed (or refused) by the broker this long after it was sent.
    fn confirmed(&self, _latency: Duration) {}
    /// Claim mode published keys a second time (never expected: an alert fires on it).
    fn published_twice(&self, _keys: u64) {}
}

static OBSERVER: OnceLock<Arc<dyn Observer>> = OnceLock::new();

/// Set the process's observer; the first call wins (one metrics registry per process).
pub fn install(observer: Arc<dyn Observer>) {
    let _ = OBSERVER.set(observer);
}

/// The process's observer, or one that ignores everything.
pub fn observer() -> &'static dyn Observer {
    struct Nobody;
    impl Observer for Nobody {}
    static NOBODY: Nobody = Nobody;
    match OBSERVER.get() {
        Some(o) => o.as_ref(),
        None => &NOBODY,
    }
}
