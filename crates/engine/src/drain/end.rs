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
        let (new, last_reason) = self.returns_found(found);
        // The canaries' own returns are their verdicts, not the drain's.
        let c = &self.status.counts;
        let returned = c.returned.saturating_sub(self.canary.came_back);
        let replayed = c.replayed.saturating_sub(self.canary.sent).max(1);
        let ratio = returned as f64 / replayed as f64;
        if new > 0 && ratio > spec.canary.max_return_ratio {
            return Ok(Some(End::TooManyReturns(returned, last_reason)));
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
        self.show_canaries();
        let c = &self.canary;
        let (phase, message) = if let Some(note) = self.pending_note.clone() {
            (Phase::Pending, note)
        } else if c.opening() {
            // Still the pre-flight: what the look-ahead holds decides whether anything moves.
            (
                Phase::Pending,
                format!(
                    "reading the first {} messages (canary.lookAhead) before anything moves",
                    c.look_ahead()
                ),
            )
        } else if c.out_count() > 0 || c.waiting() {
            let out = format!(
                "{} canaries out, waiting until {}; {} messages set aside",
                c.out_count(),
                self.wait_until,
                self.aside.len() + self.released.len()
            );
            // Canary until a signature is proven; Draining from then on, its canaries beside.
            if c.proven_any() {
                (
                    Phase::Draining,
                    format!("replaying, {left} left of this pass; {out}"),
                )
            } else {
                (Phase::Canary, out)
            }
        } else {
            (
                Phase::Draining,
                format!("replaying, {left} left of this pass"),
            )
        };
        self.status.phase = Some(phase);
        self.status.message = Some(message);
        progress.send_replace(self.status.clone());
    }

    /// The canaries into the status, when one was sent or decided since they were last shown
    /// (not at every step), with when the last wait of those out ends (HH:MM:SS, what a person
    /// compares with a clock).
    pub(super) fn show_canaries(&mut self) {
        if self.shown_revision == self.canary.revision {
            return;
        }
        self.shown_revision = self.canary.revision;
        self.status.canary = self.canary.status();
        self.wait_until = self
            .status
            .canary
            .iter()
            .filter(|c| c.result == crate::status::CanaryResult::Waiting)
            .filter_map(|c| c.wait_until.as_deref())
            .filter_map(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .max()
            .map(|t| t.format("%H:%M:%S UTC").to_string())
            .unwrap_or_default();
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
        self.status.canary = self.canary.status();
        let mut status = self.status.clone();
        let mut summary = summary(&status.counts);
        summary.push_str(&held_back(
            &self.canary.held,
            "the canary of their signature did not pass",
        ));
        summary.push_str(&held_back(
            &status.not_approved,
            "spec.expect.signatures does not approve their signature",
        ));
        let out = self.canary.out_count();
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
            End::Cancelled if out > 0 => (Phase::Suspended, format!("stopped during the canary wait, {out} canaries out (published, acked and audited; their verdict is not in): resuming sends their signatures new canaries (decided signatures keep their verdicts); {summary}")),
            End::Cancelled => (Phase::Suspended, format!("stopped; run it again to resume; {summary}")),
            End::Refused(why) => (Phase::Failed, format!("{why}; {summary}")),
            End::CanaryFailed(why) => (Phase::CanaryFailed, format!("{why}; {summary}")),
            End::Pending(why, _) => (Phase::Pending, why),
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

/// "; N held back in the queue because `why` (their signatures)", or "" when none was.
fn held_back(by_signature: &std::collections::BTreeMap<String, u64>, why: &str) -> String {
    if by_signature.is_empty() {
        return String::new();
    }
    let held: u64 = by_signature.values().sum();
    let sigs: Vec<&str> = by_signature.keys().map(String::as_str).collect();
    format!(
        "; {held} held back in the queue because {why} ({})",
        sigs.join(", ")
    )
}
