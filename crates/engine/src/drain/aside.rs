//! The canary's part of the drain: the first look-ahead, deliveries set aside while their
//! signature's canary is out and released when its verdict is in, the canaries' pre-flight,
//! and the looks for their returns (see [`crate::canary`]).

use std::time::Duration;

use super::decide::Input;
use super::{Act, Aside, Drain, End, Item};
use crate::canary::{self, search};
use crate::source::Source;
use crate::spec::IdempotencyMode;
use crate::store::Held;
use crate::watch::Returned;
use crate::{Error, Options, Progress};

/// How long a landing queue's passed pre-flight stands for the canaries that follow.
const CHECK_VALID: Duration = Duration::from_secs(30);

impl Drain<'_> {
    /// The canary's turn, once per round of the drain (`idle`: nothing in flight): end the first
    /// look-ahead once it is read, look for returns and verdicts, release what they free, and
    /// say when the pass must end.
    pub(super) async fn canary_turn(
        &mut self,
        opts: &Options,
        progress: &Progress,
        idle: bool,
    ) -> Result<Option<End>, Error> {
        if let Some(why) = self.refused.take() {
            return Ok(Some(End::Refused(why)));
        }
        if !self.canary.enabled() {
            return Ok(None);
        }
        if self.canary.opening() {
            if !idle || !self.opening_read() {
                return Ok(None);
            }
            return self.end_opening(opts, progress).await;
        }
        if self.last_look.is_none_or(|t| t.elapsed() >= opts.look) {
            self.last_look = Some(tokio::time::Instant::now());
            self.look(idle).await?;
        }
        if self.canary.pending_queues().is_some()
            && self
                .last_recheck
                .is_none_or(|t| t.elapsed() >= opts.recheck)
        {
            self.last_recheck = Some(tokio::time::Instant::now());
            self.recheck().await?;
        }
        if self.canary.take_changed() {
            self.release_due = true;
            self.save_verdicts().await?;
            self.report(progress);
        }
        // Only once every released delivery was classified: one of them may still be the first of
        // a signature whose canary has yet to go.
        if self.released.is_empty() {
            if let Some(why) = self.canary.stop() {
                return Ok(Some(End::CanaryFailed(why)));
            }
        }
        self.release();
        if idle && self.released.is_empty() && !self.canary.waiting() && self.stuck() {
            // Only signatures whose landing queue fails its pre-flight are left to wait for.
            if let Some((why, queues)) = self.canary.pending_queues() {
                return Ok(Some(End::Pending(why, queues)));
            }
        }
        Ok(None)
    }

    /// Whether the drain holds back for the canaries: reading the first look-ahead, deliveries
    /// set aside, a canary out, a wait that ends with a search.
    pub(super) fn canary_holds(&self) -> bool {
        self.canary.opening()
            || !self.aside.is_empty()
            || !self.released.is_empty()
            || self.canary.waiting()
            || self.canary.unwatched_due()
    }

    /// Whether no fresh delivery can be read now: the look-ahead is full, the pass's bound is
    /// met, or its last message waits for everything before it to be acked.
    fn stuck(&self) -> bool {
        self.aside.len() >= self.canary.look_ahead()
            || self.seen >= self.bound
            || self.source.as_ref().is_none_or(Source::at_last)
    }

    /// The first look-ahead is read: the look-ahead is full, nothing more is to be read now,
    /// or the pass met its bound.
    fn opening_read(&self) -> bool {
        self.opening_idle || self.stuck()
    }

    /// Decide on the first look-ahead (signatures, poison, the canaries' pre-flight) before
    /// anything moves, then release it into the drain. While the pre-flight fails, the
    /// look-ahead stays held and the checks run again every `opts.recheck`: handing it back at
    /// each failure would count a delivery on a quorum queue each time (a worker in a crash loop
    /// makes the check flap), and past RabbitMQ 4's delivery limit of 20 the broker drops the
    /// message. The pass ends `Pending` (handing back, once) only after `HOLD_MAX`, or when
    /// `opts.pending_timeout` gives up.
    async fn end_opening(
        &mut self,
        opts: &Options,
        progress: &Progress,
    ) -> Result<Option<End>, Error> {
        let spec = &self.replay.spec;
        if let Err(why) = self.canary.check_opening(spec.poison.max_quarantine_ratio) {
            return Ok(Some(End::Refused(why)));
        }
        let queues = self.canary.opening_queues();
        let since = *self
            .pending_since
            .get_or_insert_with(tokio::time::Instant::now);
        if self.pending_note.is_some()
            && self
                .last_recheck
                .is_some_and(|t| t.elapsed() < opts.recheck)
        {
            return Ok(None);
        }
        self.last_recheck = Some(tokio::time::Instant::now());
        let conn = self.publisher.connection();
        if let Some(why) = canary::preflight(conn, spec, &queues).await? {
            let waited = since.elapsed();
            let gave_up = opts.pending_timeout.is_some_and(|t| waited >= t);
            if gave_up || waited >= super::decide::HOLD_MAX {
                return Ok(Some(End::Pending(why, queues)));
            }
            self.pending_note = Some(format!(
                "{why}; checking again every {}s",
                opts.recheck.as_secs()
            ));
            self.report(progress);
            return Ok(None);
        }
        self.pending_note = None;
        self.canary.end_opening();
        let now = tokio::time::Instant::now();
        self.checked.extend(queues.into_iter().map(|q| (q, now)));
        self.release_due = true;
        self.release();
        self.report(progress);
        Ok(None)
    }

    /// Set-aside deliveries whose wait is over (or that waited too long, see `HOLD_MAX`) go
    /// to the released queue, in order.
    fn release(&mut self) {
        // Looked for every few seconds, not every step.
        let look = self
            .last_overdue_check
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(5));
        let overdue = look && {
            self.last_overdue_check = Some(tokio::time::Instant::now());
            self.aside.values().any(Aside::overdue)
        };
        if !(std::mem::take(&mut self.release_due) || overdue) || self.canary.opening() {
            return;
        }
        let canary = &self.canary;
        let free: Vec<u64> = self
            .aside
            .iter()
            .filter(|(_, a)| {
                a.overdue() || a.signature.as_deref().is_none_or(|s| canary.releasable(s))
            })
            .map(|(t, _)| *t)
            .collect();
        for t in free {
            if let Some(a) = self.aside.remove(&t) {
                self.released.push_back(a);
            }
        }
    }

    /// Up to `n` released deliveries, for the next step.
    pub(super) fn take_released(&mut self, n: usize) -> Vec<Input> {
        let n = n.min(self.released.len());
        self.released.drain(..n).map(Input::from).collect()
    }

    /// Take the step's set-aside items out of it: they stay unacked, and no multiple ack of a
    /// later step may cover them.
    pub(super) fn set_aside(&mut self, items: &mut Vec<Item>) {
        if !items.iter().any(|it| matches!(it.act, Act::Aside(_))) {
            return;
        }
        let mut tags = Vec::new();
        for it in std::mem::take(items) {
            match it.act {
                Act::Aside(signature) => {
                    let tag = it.delivery.delivery_tag;
                    tags.push(tag);
                    self.aside.insert(
                        tag,
                        Aside {
                            delivery: it.delivery,
                            signature,
                            met: it.met,
                            since: tokio::time::Instant::now(),
                        },
                    );
                }
                _ => items.push(it),
            }
        }
        if let Some(src) = self.source.as_mut() {
            src.hold(&tags);
        }
    }

    /// Before a step's canaries go: the queue each lands on passes its pre-flight (else its
    /// signature waits for it, the canary set aside), and the return watch is bound to every
    /// dead-letter route met so far.
    pub(super) async fn prepare_canaries(&mut self, items: &mut [Item]) -> Result<(), Error> {
        if !items.iter().any(|it| it.canary) {
            return Ok(());
        }
        let spec = &self.replay.spec;
        for it in items.iter_mut().filter(|it| it.canary) {
            let Some(q) = canary::landing_queue(spec, &it.delivery) else {
                continue;
            };
            if self
                .checked
                .get(&q)
                .is_some_and(|t| t.elapsed() < CHECK_VALID)
            {
                continue;
            }
            match canary::preflight(self.publisher.connection(), spec, std::slice::from_ref(&q))
                .await?
            {
                None => {
                    self.checked.insert(q, tokio::time::Instant::now());
                }
                Some(why) => {
                    self.canary.pending(&it.signature, why, q);
                    it.canary = false;
                    it.key = None;
                    it.act = Act::Aside(Some(it.signature.clone()));
                    self.selected = self.selected.saturating_sub(1);
                }
            }
        }
        if let (Some(w), Some(conn)) = (self.returns.as_mut(), self.src_conn.as_ref()) {
            w.bind(conn, &self.routes).await?;
        }
        Ok(())
    }

    /// What a canary's landing made of it: out and watched, not publishable (its signature
    /// held back), or not a canary after all (a duplicate, settled before, not sent).
    pub(super) fn canary_landed(&mut self, item: &Item) {
        match &item.act {
            Act::Replayed(_) => {
                let watched = self.returns.as_ref().is_some_and(|r| r.watching());
                self.canary.sent(
                    &item.signature,
                    &item.identity,
                    item.key.as_deref(),
                    watched,
                );
            }
            // The broker refused it (nacked, unroutable, no exchange): its signature cannot be
            // proven. A channel that closed under it says nothing of the message.
            Act::Failed(why) if !self.ending && !why.starts_with("NotSent") => {
                self.canary
                    .not_published(&item.signature, &item.identity, why);
            }
            _ => self.canary.unchosen(&item.signature),
        }
        self.release_due = true;
    }

    /// Look for the canaries' verdicts: returns on the watch, keys marked done (Check mode),
    /// waits that are over (after a search of the watched queues, for a canary no route can
    /// bring back, which needs the drain `idle`).
    async fn look(&mut self, idle: bool) -> Result<(), Error> {
        if self.canary.out_count() == 0 {
            return Ok(());
        }
        let spec = &self.replay.spec;
        if let Some(w) = &self.returns {
            let found = w
                .poll(&self.replay_id, &spec.canary.signature_header)
                .await?;
            self.returns_found(found);
        }
        self.confirm_done().await?;
        if self.canary.unwatched_due() {
            if !idle {
                return Ok(());
            }
            let Some(conn) = self.src_conn.clone() else {
                return Ok(());
            };
            let found = search::search(
                &conn,
                self.publisher.connection(),
                self.store.redis(),
                &self.replay.amqp_url,
                spec,
                &self.replay_id,
            )
            .await?;
            self.returns_found(found);
        }
        self.canary.expire();
        Ok(())
    }

    /// This replay's dead letters seen coming back: a canary's return decides its signature;
    /// every one is counted once. Returns how many that were not canaries are new, and the
    /// last one's reason.
    pub(super) fn returns_found(&mut self, found: Vec<Returned>) -> (u64, String) {
        let (mut new, mut last) = (0, String::new());
        for r in found {
            let canary = self.canary.returned(&r.identity, &r.reason);
            if self.returns_behind.insert(r.fingerprint) {
                self.status.counts.returned += 1;
                if !canary {
                    new += 1;
                    last = r.reason;
                }
            }
        }
        (new, last)
    }

    /// Check mode: a canary whose key the worker marked done is confirmed.
    async fn confirm_done(&mut self) -> Result<(), Error> {
        let Some(idem) = self
            .replay
            .spec
            .idempotency
            .as_ref()
            .filter(|i| i.mode == IdempotencyMode::Check)
        else {
            return Ok(());
        };
        let keys = self.canary.keys_out();
        if keys.is_empty() {
            return Ok(());
        }
        let mut redis = self.store.redis();
        let values: Vec<Option<String>> = redis::cmd("MGET")
            .arg(keys.iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>())
            .query_async(&mut redis)
            .await?;
        for ((i, _), v) in keys.into_iter().zip(values) {
            if Held::of(v.as_deref(), &idem.done_value) == Held::Done {
                self.canary.confirmed(i);
            }
        }
        Ok(())
    }

    /// Check again the landing queues that hold signatures back.
    async fn recheck(&mut self) -> Result<(), Error> {
        let Some((_, queues)) = self.canary.pending_queues() else {
            return Ok(());
        };
        for q in queues {
            let conn = self.publisher.connection();
            if canary::preflight(conn, &self.replay.spec, std::slice::from_ref(&q))
                .await?
                .is_none()
            {
                self.canary.cleared(&q);
                self.checked.insert(q, tokio::time::Instant::now());
                self.release_due = true;
            }
        }
        Ok(())
    }

    /// Store the verdicts, so a resumed replay does not send a decided signature's canary again,
    /// and show them.
    async fn save_verdicts(&mut self) -> Result<(), Error> {
        self.show_canaries();
        let json =
            serde_json::to_string(&self.status.canary).map_err(|e| Error::Redis(e.to_string()))?;
        self.store.save_canary(&json).await
    }
}
