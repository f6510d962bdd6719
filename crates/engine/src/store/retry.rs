//! Asking Redis again when an answer was lost: how long, how often, and what the replay's stop
//! and status say meanwhile.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Store;
use crate::Error;

const RETRY_MAX_DELAY: Duration = Duration::from_secs(4);

/// After the replay was stopped, a lost call is still asked again for this long (a Redis blip
/// is short, and a commit's publishes are confirmed), and then given up, leaving the batch as a
/// crash would: the stop must take effect within seconds, not after the whole budget.
const RETRY_AFTER_STOP: Duration = Duration::from_secs(5);

/// The retries of one Redis call whose answer was lost: 0.25 s doubling to 4 s with jitter (a
/// Redis that paused or restarted is back soon, and the batch's messages are held meanwhile),
/// for as long as the budget allows.
pub(super) struct Retries {
    started: tokio::time::Instant,
    budget: Duration,
    delays: backon::ExponentialBackoff,
    /// The replay's stop, and when this call first saw it.
    stop: Option<CancellationToken>,
    stopped_at: Option<tokio::time::Instant>,
}

impl Retries {
    pub(super) fn new(budget: Duration, stop: Option<CancellationToken>) -> Self {
        Self {
            started: tokio::time::Instant::now(),
            budget,
            delays: crate::backoff(RETRY_MAX_DELAY),
            stop,
            stopped_at: None,
        }
    }

    /// How long to wait before asking again after `e`; `None`: give up (not a lost answer, or
    /// the budget is spent, or the replay was stopped more than [`RETRY_AFTER_STOP`] ago).
    pub(super) fn next(&mut self, e: &Error) -> Option<Duration> {
        let delay = self.delays.next().unwrap_or(RETRY_MAX_DELAY);
        let mut ok = e.is_transient() && self.started.elapsed() + delay <= self.budget;
        if self.stop.as_ref().is_some_and(|s| s.is_cancelled()) {
            let since = *self
                .stopped_at
                .get_or_insert_with(tokio::time::Instant::now);
            ok &= since.elapsed() + delay <= RETRY_AFTER_STOP;
        }
        ok.then_some(delay)
    }
}

impl Store {
    /// How long a lookup or commit whose answer was lost is tried again (zero: not at all).
    pub fn retry_for(&mut self, budget: Duration) {
        self.retry_for = budget;
    }

    /// Let `stop` (the replay's cancellation) end a wait between retries: the call is then asked
    /// again only for a few seconds more ([`RETRY_AFTER_STOP`]) before it is given up.
    pub fn stop_on(&mut self, stop: CancellationToken) {
        self.stop = Some(stop);
    }

    /// Say in `progress`'s status message when a batch waits for Redis (the next report of
    /// the drain replaces it).
    pub fn report_waits_to(&mut self, progress: crate::Progress) {
        self.waits = Some(progress);
    }

    /// One more retry of `what`: counted, logged, said in the status, then waited for.
    pub(super) async fn wait_to_retry(&self, what: &str, e: &Error, delay: Duration) {
        crate::observe::observer().retried(what);
        tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, call = what, "a Redis answer was lost; asking again");
        if let Some(p) = &self.waits {
            p.send_modify(|s| {
                s.message = Some(format!(
                    "WaitingForRedis: {e}; the batch in hand is held (nothing published unchecked, nothing acked unrecorded); asking again in {:.1}s",
                    delay.as_secs_f64()
                ))
            });
        }
        match &self.stop {
            // The first wait after a stop is cut short; those of the few seconds after it are not
            // (they are what spaces the last asks).
            Some(stop) if !stop.is_cancelled() => {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = stop.cancelled() => {}
                }
            }
            _ => tokio::time::sleep(delay).await,
        }
    }
}
