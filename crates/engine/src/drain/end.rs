//! How a pass ends: the queue found empty, too many replayed messages coming back, or the
//! pass closed with its final status.

use super::{source, Drain, End};
use crate::status::{Phase, ReplayStatus};
use crate::Error;
use crate::{now, summary, Options, Progress};

impl Drain<'_> {
    pub(super) fn forget_failed(&mut self) {
        self.failed_keys.clear();
        self.closed_on = None;
    }

    /// While draining, watch for replayed messages that die again. They land behind the pass's
    /// bound, so the consumer never sees them: the watch queue on the dead-letter routes gets a
    /// copy of each new dead letter, and this replay's are counted. Above
    /// `canary.maxReturnRatio` of the replayed, stop. Without a known route there is nothing to
    /// watch while draining (a traversal would compete with the drain's own consumer).
    pub(super) async fn check_returns(&mut self, opts: &Options) -> Result<Option<End>, Error> {
        let spec = &self.replay.spec;
        let Some(watch) = self.returns.as_ref().filter(|_| spec.canary.enabled) else {
            return Ok(None);
        };
        let due = self
            .last_return_check
            .is_none_or(|t| t.elapsed() >= opts.return_check);
        if !due {
            return Ok(None);
        }
        self.last_return_check = Some(tokio::time::Instant::now());
        let found = watch
            .poll(&self.replay_id, &spec.canary.signature_header)
            .await?;
        let before = self.returns_behind.len();
        let mut last_reason = String::new();
        for r in found {
            if self.returns_behind.insert(r.fingerprint) {
                last_reason = r.reason;
            }
        }
        let new = (self.returns_behind.len() - before) as u64;
        self.status.counts.returned += new;
        let replayed = self.status.counts.replayed.max(1);
        let ratio = self.status.counts.returned as f64 / replayed as f64;
        if new > 0 && ratio > spec.canary.max_return_ratio {
            return Ok(Some(End::TooManyReturns(
                self.status.counts.returned,
                last_reason,
            )));
        }
        Ok(None)
    }

    pub(super) async fn queue_is_empty(&self) -> Result<bool, Error> {
        let conn = self.publisher.connection();
        Ok(source::queue_state(conn, &self.replay.spec.source.queue)
            .await?
            .is_none_or(|s| s.0 == 0))
    }

    pub(super) fn report(&mut self, progress: &Progress) {
        let left = self.bound.saturating_sub(self.seen);
        self.status.message = Some(format!("replaying, {left} left of this pass"));
        progress.send_replace(self.status.clone());
    }

    /// Close the pass: everything still unacked goes back to the queue in place.
    pub(crate) async fn finish(&mut self, end: End) -> ReplayStatus {
        if let Some(src) = self.source.take() {
            let took_all = src.took_all();
            if let Err(e) = src.close().await {
                tracing::warn!(error = %e, "closing the dead-letter queue channel");
            } else if took_all {
                self.take_back_moved().await;
            }
        }
        let mut status = self.status.clone();
        let mut summary = summary(&status.counts);
        if !self.unproven.is_empty() {
            let held: u64 = self.unproven.values().sum();
            let sigs: Vec<&str> = self.unproven.keys().map(String::as_str).collect();
            summary.push_str(&format!(
                "; {held} held back because no canary proved their signature ({}): they arrived after the canaries were chosen and stay in the queue for a new replay to canary",
                sigs.join(", ")
            ));
        }
        let (phase, message) = match end {
            // Past selector.limit the pass went on to its bound, skipping: a message that stays
            // is moved like any skipped one, so the DLQ keeps its order.
            End::Drained if self.limit_reached() => {
                (Phase::Done, format!("selector.limit reached; {summary}"))
            }
            End::Drained => (Phase::Done, summary),
            End::TooManyReturns(n, why) => (
                Phase::Failed,
                format!(
                    "TooManyReturns: {n} replayed messages came back (last: {why}), more than canary.maxReturnRatio {} of the replayed; stopped, the rest is still in the dead-letter queue; {summary}",
                    self.replay.spec.canary.max_return_ratio
                ),
            ),
            End::Cancelled => (Phase::Suspended, format!("stopped; run it again to resume; {summary}")),
            End::Error(e) => (Phase::Failed, format!("{e}; unsettled messages are still in the dead-letter queue; run it again to resume")),
        };
        status.phase = Some(phase);
        status.message = Some(message);
        if phase == Phase::Done {
            status.finished_at = Some(now());
        }
        status
    }
}
