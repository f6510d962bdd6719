//! Admitting a step: what the next step may take (released set-aside deliveries first, then
//! fresh ones, within the window, the bound and the canaries' look-ahead), and a step classified,
//! gated and sent, alone or beside the landing of the one before it.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::decide::Input;
use super::{gate, settle, unsent, Drain, Flight, Item};
use crate::source::Source;
use crate::Error;

impl Drain<'_> {
    /// What the next step may take: released set-aside deliveries first, else fresh ones
    /// (`true`), waiting up to `wait` for them. `None` when nothing is to be admitted now (see
    /// [`Drain::room`]); an empty batch when nothing was ready.
    pub(super) async fn next_inputs(
        &mut self,
        busy: usize,
        landing: bool,
        wait: Duration,
        cancel: &CancellationToken,
    ) -> Result<Option<(Vec<Input>, bool)>, Error> {
        // A wait that ends with a search of the queue needs the drain still.
        if cancel.is_cancelled() || self.canary.unwatched_due() {
            return Ok(None);
        }
        if !self.released.is_empty() {
            return Ok(self
                .window_room(busy, landing)
                .map(|n| (self.take_released(n), false)));
        }
        let Some(more) = self.room(busy, landing, cancel) else {
            return Ok(None);
        };
        let Some(src) = self.source.as_mut() else {
            return Ok(None);
        };
        let deliveries = src.next_batch(more, wait).await?;
        Ok(Some((self.fresh(deliveries), true)))
    }

    /// How many deliveries the window lets the next step take: while a step is in flight, only
    /// a whole step.
    fn window_room(&self, busy: usize, landing: bool) -> Option<usize> {
        let in_flight = landing || busy > 0 || !self.pending.is_empty();
        let free = self.window.saturating_sub(busy);
        if in_flight && free < self.step {
            return None;
        }
        Some(self.step.min(free.max(1)))
    }

    /// How many fresh deliveries the next step may take, or `None` when none is to be read
    /// now: the window is full, the pass met its bound, the replay is stopping, the canaries'
    /// look-ahead is full, or the next delivery is the pass's last one (taken alone once every
    /// delivery before it is acked, none set aside: see [`crate::source::get_one`]).
    fn room(&self, busy: usize, landing: bool, cancel: &CancellationToken) -> Option<usize> {
        if cancel.is_cancelled() || self.seen >= self.bound || self.source.is_none() {
            return None;
        }
        // At most the look-ahead set aside: a step reads no more than it has room for.
        let ahead = if self.canary.enabled() {
            self.canary.look_ahead().checked_sub(self.aside.len())?
        } else {
            usize::MAX
        };
        if ahead == 0 {
            return None;
        }
        let in_flight = landing || busy > 0 || !self.pending.is_empty();
        let last = self.source.as_ref().is_some_and(Source::at_last);
        if last && (in_flight || !self.aside.is_empty()) {
            return None;
        }
        let n = self.window_room(busy, landing)?;
        Some(n.min(ahead).min((self.bound - self.seen) as usize))
    }

    /// Classify, check the canaries' ground, set aside, gate and send one step (`None`: all of
    /// it was set aside; see [`Drain::settle_and_admit`] for what a failure hands back).
    pub(super) async fn admit(
        &mut self,
        inputs: Vec<Input>,
        fresh: bool,
    ) -> Result<Option<Flight>, (Option<Flight>, Error)> {
        let mut items = self.classify(inputs, fresh);
        if let Err(e) = self.prepare_canaries(&mut items).await {
            return Err((None, e));
        }
        self.set_aside(&mut items);
        if items.is_empty() {
            return Ok(None);
        }
        if let Err(e) = self.gate(&mut items).await {
            return Err((None, e));
        }
        match self.send(&mut items).await {
            Ok(confirms) => Ok(Some(Flight {
                items,
                confirms,
                sent: std::time::Instant::now(),
            })),
            Err(e) => Err((Some(unsent(items)), e)),
        }
    }

    /// Record the landing step and admit the next together: the step's commit and the next
    /// step's lookup go to Redis at once, the commit first, so the claims taken never outnumber
    /// the window. Meanwhile the landing step's kept messages are moved to the tail: their
    /// confirms are waited for beside the commit and the next step's publishes, so a move adds
    /// no wait of its own to the drain (one after the other, a held-back message every hundred
    /// slowed the whole drain by 10-15 %: bench/RESULTS.md, canary section). The landing step
    /// is acked once both are in. A step that cannot be sent (the commit failed, a publish of
    /// the landing step went unconfirmed, or the publishing channel could not open) is handed
    /// back as a flight with nothing sent, for `land_all` to release its claims.
    pub(super) async fn settle_and_admit(
        &mut self,
        items: Vec<Item>,
        inputs: Vec<Input>,
        fresh: bool,
    ) -> (
        Result<(), Error>,
        Result<Option<Flight>, (Option<Flight>, Error)>,
    ) {
        let mut next = self.classify(inputs, fresh);
        if let Err(e) = self.prepare_canaries(&mut next).await {
            // Nothing of the next step is sent: it stays unacked, back in the queue when the
            // pass closes.
            return (self.settle(items).await, Err((None, e)));
        }
        self.set_aside(&mut next);
        let mut items = items;
        let record = self.record(&mut items);
        let mut keeper = self.keeper.take();
        let (moves, (answer, admitted)) = tokio::join!(
            settle::keep_moves(keeper.as_mut(), &items),
            self.commit_and_admit(&record, next),
        );
        self.keeper = keeper;
        // A failed move leaves its messages unacked (back in the queue with the channel); the
        // rest of the step is recorded and acked as usual, and the pass ends.
        let moved = moves.map(|m| self.pend(&items, m));
        let landed = self.recorded(record, answer).await.and(moved);
        (landed, admitted)
    }

    /// The landing step's commit with the next step's lookups, then the next step's publishes.
    async fn commit_and_admit(
        &mut self,
        record: &settle::Record,
        mut next: Vec<Item>,
    ) -> (
        Result<(u64, u64), Error>,
        Result<Option<Flight>, (Option<Flight>, Error)>,
    ) {
        let ask = gate::Ask::of(&next);
        let claim = gate::claim(self.replay, &self.claim_value);
        let (answer, lookups) = tokio::join!(
            record.commit(&mut self.store),
            ask.lookup(&mut self.gate_store, &next, claim),
        );
        let lookups = match lookups {
            Ok(l) => l,
            Err(e) => return (answer, Err((None, e))),
        };
        self.decide(&mut next, &ask, lookups);
        // The landing step's record (`self.ending`: an unconfirmed publish) ends the pass.
        if answer.is_err() || self.ending {
            return (answer, Ok(Some(unsent(next)).filter(|f| f.len() > 0)));
        }
        if next.is_empty() {
            return (answer, Ok(None));
        }
        let admitted = match self.send(&mut next).await {
            Ok(confirms) => Ok(Some(Flight {
                items: next,
                confirms,
                sent: std::time::Instant::now(),
            })),
            Err(e) => Err((Some(unsent(next)), e)),
        };
        (answer, admitted)
    }
}
