//! The drain: every message of the pass decided, published, recorded and acknowledged, as a
//! pipeline of small steps.
//!
//! A step is a handful of deliveries taken through the stages in order: classify, gate (one
//! Redis round trip: lookups and claims), send (publishes, confirms not awaited), then, once its
//! confirms are in, keep (kept messages moved to the tail), settle (one Redis commit: audit rows,
//! settled marks, claims marked published or released, counts) and the acks. Several steps are in
//! flight at once, so the broker works on the next step's publishes while the previous one's
//! confirms come back and are recorded. Steps land strictly in order: commits and acks never
//! overtake, and no message is acked before its outcome is durable. A kept message's copy is
//! the one outcome a landing does not wait for: its original is acked at a later landing, once
//! the copy is confirmed ([`Drain::pend`]).
//!
//! The window (`Options::window`) bounds the messages between gate and settle: claimed or
//! published, not yet recorded. It is what a crash (kill -9) can leave unknown: in Claim mode
//! those keys are quarantined `OutcomeUnknown` by the next run, in Check mode published again.

mod gate;
mod send;
mod settle;

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use governor::DefaultDirectRateLimiter;
use lapin::message::Delivery;
use lapin::{Connection, PublisherConfirm};
use tokio_util::sync::CancellationToken;

use super::classify::{self, Destination, Rules, SkipReason, Verdict};
use super::source::{self, Source};
use super::store::{self, Store};
use super::{
    keep, limiter, message, now, proven, publish, summary, watch, Options, Progress, Replay,
};
use crate::api::{DlqReplayStatus, Phase};
use crate::Error;

/// What happens to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Act {
    Skip {
        reason: String,
        returned: bool,
    },
    Quarantine(String),
    Replay(Destination),
    Duplicate {
        reason: String,
        same_attempt: bool,
    },
    AlreadySettled,
    /// A second copy of a message this pass already met, left by an interrupted move (the
    /// ledger counts it): dropped, with an audit row.
    Leftover,
    Replayed(Destination),
    Quarantined(String),
    Failed(String),
    /// Published, but the connection went away before the broker's confirm: maybe delivered,
    /// maybe not. Nothing is recorded and nothing acked; the next pass finds its claim (Claim
    /// mode: quarantined `OutcomeUnknown`) or publishes it again (Check mode).
    Unknown(String),
    /// Not published because the replay was stopped while the step waited for the rate
    /// limiter: nothing recorded, its claim released, left unacked (back in the queue when the
    /// pass closes its channel), decided by the next run.
    Unsent,
}

pub(super) struct Item {
    delivery: Delivery,
    /// The move ledger's digest, computed when needed (a kept or a leftover message).
    digest: Option<String>,
    /// What audit rows call the message (message id or body hash).
    identity: String,
    /// What the settled marks call it: a hash of message id and body.
    fingerprint: String,
    key: Option<String>,
    act: Act,
}

pub(super) enum End {
    Drained,
    TooManyReturns(u64, String),
    Cancelled,
    Error(Error),
}

/// A step that was decided but not sent: what it would have published stays in the queue,
/// decided again by the next pass, and its claims are released when it lands.
fn unsent(mut items: Vec<Item>) -> Flight {
    for it in &mut items {
        if matches!(it.act, Act::Replay(_) | Act::Quarantine(_)) {
            it.act = Act::Unsent;
        }
    }
    Flight {
        items,
        confirms: Vec::new(),
        sent: std::time::Instant::now(),
    }
}

/// A move whose copy is on its way: its original's delivery tag and digest, then what became of
/// the copy. `Sync`, as the drain is shared by reference across awaits in a spawned task.
type PendingMove =
    std::pin::Pin<Box<dyn std::future::Future<Output = (u64, String, keep::Moved)> + Send + Sync>>;

/// A step between its send and its landing: the items, and the confirms of what it published.
struct Flight {
    items: Vec<Item>,
    confirms: Vec<(usize, PublisherConfirm)>,
    sent: std::time::Instant,
}

impl Flight {
    /// Messages of the step that count against the window.
    fn len(&self) -> usize {
        self.items.len()
    }
}

pub(super) struct Drain<'a> {
    replay: &'a Replay,
    replay_id: String,
    claim_value: String,
    source: Option<Source>,
    publisher: publish::Publisher,
    pub(super) store: Store,
    /// The same connection, for the next step's lookup while a step's commit is on its way.
    gate_store: Store,
    limiter: Option<DefaultDirectRateLimiter>,
    status: DlqReplayStatus,
    bound: u64,
    seen: u64,
    selected: u64,
    /// Messages between gate and settle at most (see the module doc).
    window: usize,
    /// Deliveries per step.
    step: usize,
    /// Keys whose publish failed, was left unsent (`true`) or may not have gone out, in steps
    /// landed while later ones were in flight: a later step's "already claimed by this attempt"
    /// for such a key is no duplicate (see `resolve`). Forgotten when nothing is in flight.
    failed_keys: HashMap<String, bool>,
    /// Why the publishing channel closed, for the messages later steps could not send.
    closed_on: Option<String>,
    /// A step had publishes left unconfirmed: the pass ends, and what later steps failed stays
    /// in the queue for the next pass to decide (and count).
    ending: bool,
    /// The signatures the canaries proved; the others' messages stay in the queue.
    pub(super) proven: proven::Proven,
    /// Messages held back because no canary met their signature, per signature.
    unproven: std::collections::BTreeMap<String, u64>,
    /// Messages of this replay that came back (by fingerprint) behind the pass's bound.
    returns_behind: HashSet<String>,
    last_return_check: Option<tokio::time::Instant>,
    /// Moves kept messages to the tail, and the ledger of copies a crash may have doubled.
    pub(super) keeper: Option<(keep::Mover, keep::Ledger)>,
    /// The dead-letter routes seen (and known before), for the return watch.
    pub(super) routes: std::collections::BTreeSet<watch::Route>,
    /// The return watch, when a route is known.
    pub(super) returns: Option<watch::Returns>,
    /// Digests of the messages this pass moved, but for the latest step's: their ledger counts
    /// come back when the pass has taken its last message (see `finish`).
    moved: Vec<String>,
    /// The latest landing's, whose acks nothing after them waits for.
    last_moved: Vec<String>,
    /// Moves whose copies are not confirmed yet: the original's delivery tag and digest, and
    /// what became of the copy (see [`Drain::pend`]).
    pending: futures::stream::FuturesUnordered<PendingMove>,
    /// The replay's stop, for the waits inside a step (the rate limiter).
    pub(super) cancel: CancellationToken,
}

impl<'a> Drain<'a> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        replay: &'a Replay,
        state: &store::State,
        source: Source,
        publisher: publish::Publisher,
        store: Store,
        status: DlqReplayStatus,
        bound: u64,
        (window, step): (usize, usize),
    ) -> Self {
        Self {
            replay,
            replay_id: state.replay_id.clone(),
            claim_value: format!("{}/{}", state.replay_id, state.attempt),
            source: Some(source),
            publisher,
            gate_store: store.clone(),
            store,
            limiter: limiter(&replay.spec),
            // A resumed replay's earlier selections count against the limit.
            selected: state.counts.scanned - state.counts.skipped,
            status,
            bound,
            seen: 0,
            window,
            step,
            failed_keys: HashMap::new(),
            closed_on: None,
            ending: false,
            proven: Default::default(),
            unproven: Default::default(),
            returns_behind: Default::default(),
            last_return_check: None,
            keeper: None,
            routes: Default::default(),
            returns: None,
            moved: Vec::new(),
            last_moved: Vec::new(),
            pending: Default::default(),
            cancel: CancellationToken::new(),
        }
    }

    /// Run the pass: admit steps while the window has room, land the oldest when it is full or
    /// nothing more is ready, until the bound is met, the replay stops or something fails. What
    /// is in flight then lands before the pass ends.
    pub(super) async fn run(
        &mut self,
        opts: &Options,
        progress: &Progress,
        cancel: &CancellationToken,
    ) -> End {
        let mut flights: VecDeque<Flight> = VecDeque::new();
        let mut stalled = Duration::ZERO;
        let end = loop {
            let busy = flights.iter().map(Flight::len).sum();
            if let Some(more) = self.room(busy, false, cancel) {
                // Never wait for deliveries while a step's confirms (or a move's) may be ready.
                let wait = if flights.is_empty() && self.pending.is_empty() {
                    opts.idle
                } else {
                    Duration::ZERO
                };
                let Some(src) = self.source.as_mut() else {
                    break End::Drained;
                };
                let deliveries = match src.next_batch(more, wait).await {
                    Ok(d) => d,
                    Err(e) => break End::Error(e),
                };
                if !deliveries.is_empty() {
                    stalled = Duration::ZERO;
                    match self.admit(deliveries).await {
                        Ok(f) => flights.push_back(f),
                        Err((f, e)) => {
                            flights.extend(f);
                            break End::Error(e);
                        }
                    }
                    continue;
                }
                if flights.is_empty() && self.pending.is_empty() {
                    match self.queue_is_empty().await {
                        Ok(true) => break End::Drained,
                        Ok(false) if stalled >= opts.stall => {
                            break End::Error(Error::Broker(format!(
                                "the dead-letter queue holds messages but delivered none for {}s (another consumer, or a consumer timeout?)",
                                opts.stall.as_secs()
                            )))
                        }
                        Ok(false) => stalled += opts.idle,
                        Err(e) => break End::Error(e),
                    }
                    continue;
                }
            }
            let Some(flight) = flights.pop_front() else {
                // Nothing in flight but moves: their originals' acks come before the pass's
                // last message (see `room`) and before it ends.
                if !self.pending.is_empty() {
                    if let Err(e) = self.ack_moved(true).await {
                        break End::Error(e);
                    }
                    continue;
                }
                break if cancel.is_cancelled() {
                    End::Cancelled
                } else {
                    End::Drained
                };
            };
            let items = self.confirmed(flight).await;
            // The next step, if it may follow once this one has landed, is admitted with it.
            let busy = flights.iter().map(Flight::len).sum();
            let next = match self.following(busy, cancel).await {
                Ok(next) => next,
                Err(e) => {
                    if let Err(e) = self.settle(items).await {
                        tracing::debug!(error = %e, "landing a step after the pass ended");
                    }
                    break End::Error(e);
                }
            };
            if next.is_empty() {
                if let Err(e) = self.settle(items).await {
                    break End::Error(e);
                }
            } else {
                let (landed, admitted) = self.settle_and_admit(items, next).await;
                let admitted = match admitted {
                    Ok(f) => {
                        flights.push_back(f);
                        None
                    }
                    Err((f, e)) => {
                        flights.extend(f);
                        Some(e)
                    }
                };
                if let Some(e) = landed.err().or(admitted) {
                    break End::Error(e);
                }
            }
            if flights.is_empty() {
                self.forget_failed();
            }
            match self.check_returns(opts).await {
                Ok(Some(end)) => break end,
                Ok(None) => {}
                Err(e) => break End::Error(e),
            }
            self.report(progress);
        };
        self.land_all(flights).await;
        end
    }

    /// How many deliveries the next step may take, or `None` when nothing is to be admitted
    /// now: the window is full, the pass met its bound, the replay is stopping, or the next
    /// delivery is the pass's last one (taken alone once everything before it is acked, see
    /// [`source::get_one`]).
    fn room(&self, busy: usize, landing: bool, cancel: &CancellationToken) -> Option<usize> {
        if cancel.is_cancelled() || self.seen >= self.bound || self.source.is_none() {
            return None;
        }
        let in_flight = landing || busy > 0 || !self.pending.is_empty();
        let free = self.window.saturating_sub(busy);
        let last = self.source.as_ref().is_some_and(Source::at_last);
        // While a step is in flight, admit only a whole step, and never the pass's last message.
        if in_flight && (free < self.step || last) {
            return None;
        }
        Some(
            self.step
                .min(free.max(1))
                .min((self.bound - self.seen) as usize),
        )
    }

    /// Classify, gate and send one step (see [`Drain::settle_and_admit`] for what a failure hands
    /// back).
    async fn admit(
        &mut self,
        deliveries: Vec<Delivery>,
    ) -> Result<Flight, (Option<Flight>, Error)> {
        let mut items = self.classify(deliveries);
        if let Err(e) = self.gate(&mut items).await {
            return Err((None, e));
        }
        match self.send(&mut items).await {
            Ok(confirms) => Ok(Flight {
                items,
                confirms,
                sent: std::time::Instant::now(),
            }),
            Err(e) => Err((Some(unsent(items)), e)),
        }
    }

    /// The deliveries of the step that may follow the one landing now (none when the window or
    /// the last-message rule says wait, or none are ready).
    async fn following(
        &mut self,
        busy: usize,
        cancel: &CancellationToken,
    ) -> Result<Vec<Delivery>, Error> {
        let more = self.room(busy, true, cancel);
        match (more, self.source.as_mut()) {
            (Some(more), Some(src)) => src.next_batch(more, Duration::ZERO).await,
            _ => Ok(Vec::new()),
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
    async fn settle_and_admit(
        &mut self,
        items: Vec<Item>,
        deliveries: Vec<Delivery>,
    ) -> (Result<(), Error>, Result<Flight, (Option<Flight>, Error)>) {
        let record = self.record(&items);
        let next = self.classify(deliveries);
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
        Result<Flight, (Option<Flight>, Error)>,
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
            return (answer, Ok(unsent(next)));
        }
        let admitted = match self.send(&mut next).await {
            Ok(confirms) => Ok(Flight {
                items: next,
                confirms,
                sent: std::time::Instant::now(),
            }),
            Err(e) => Err((Some(unsent(next)), e)),
        };
        (answer, admitted)
    }

    /// Wait for a step's confirms, then keep, record and acknowledge it.
    async fn land(&mut self, flight: Flight) -> Result<(), Error> {
        let items = self.confirmed(flight).await;
        self.settle(items).await
    }

    /// A step's items once its confirms are in.
    async fn confirmed(&mut self, flight: Flight) -> Vec<Item> {
        let Flight {
            mut items,
            confirms,
            sent,
        } = flight;
        self.resolve(&mut items, confirms, sent).await;
        items
    }

    /// After a failure, land every step still in flight, in order: what was confirmed is
    /// recorded and acked (its claims marked published), what was not stays in the queue with
    /// its claim (an unknown outcome) or released (a publish that failed). Their errors are
    /// those of the failure that ended the pass, already reported.
    async fn land_all(&mut self, flights: VecDeque<Flight>) {
        for flight in flights {
            if let Err(e) = self.land(flight).await {
                tracing::debug!(error = %e, "landing a step after the pass ended");
            }
        }
        if let Err(e) = self.ack_moved(true).await {
            tracing::debug!(error = %e, "acking moved messages after the pass ended");
        }
        self.forget_failed();
    }

    fn forget_failed(&mut self) {
        self.failed_keys.clear();
        self.closed_on = None;
    }

    /// While draining, watch for replayed messages that die again. They land behind the pass's
    /// bound, so the consumer never sees them: the watch queue on the dead-letter routes gets a
    /// copy of each new dead letter, and this replay's are counted. Above
    /// `canary.maxReturnRatio` of the replayed, stop. Without a known route there is nothing to
    /// watch while draining (a traversal would compete with the drain's own consumer).
    async fn check_returns(&mut self, opts: &Options) -> Result<Option<End>, Error> {
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

    /// Whether both of the pass's broker connections are still up (an error on a channel can be
    /// the echo of a connection that went away).
    pub(super) fn connected(&self, src_conn: &Connection) -> bool {
        src_conn.status().connected() && self.publisher.connection().status().connected()
    }

    fn limit_reached(&self) -> bool {
        self.replay
            .spec
            .selector
            .limit
            .is_some_and(|l| self.selected >= l)
    }

    async fn queue_is_empty(&self) -> Result<bool, Error> {
        let conn = self.publisher.connection();
        Ok(source::queue_state(conn, &self.replay.spec.source.queue)
            .await?
            .is_none_or(|s| s.0 == 0))
    }

    fn classify(&mut self, deliveries: Vec<Delivery>) -> Vec<Item> {
        let rules = Rules::of(&self.replay.spec, &self.replay_id);
        let mut items = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            if self.seen >= self.bound {
                // Prefetched beyond the bound: not ours; it goes back untouched when the channel
                // closes.
                break;
            }
            self.seen += 1;
            watch::note_route(&mut self.routes, &delivery);
            let props = &delivery.properties;
            let identity = message::identity(props, &delivery.data);
            let fingerprint = message::fingerprint(props, &delivery.data);
            let met = self
                .keeper
                .as_mut()
                .and_then(|(_, ledger)| ledger.meet(props, &delivery.data));
            if let Some((d, true)) = met {
                items.push(Item {
                    delivery,
                    identity,
                    fingerprint,
                    digest: Some(d),
                    key: None,
                    act: Act::Leftover,
                });
                continue;
            }
            let digest = met.map(|(d, _)| d);
            let verdict = if self.limit_reached() {
                Verdict::Skip(SkipReason::NotSelected("selector.limit reached".into()))
            } else {
                classify::classify(&rules, props, &delivery.data)
            };
            let (act, key) = match verdict {
                Verdict::Skip(SkipReason::Returned) => (
                    Act::Skip {
                        reason: "returned: died again after this replay".into(),
                        returned: true,
                    },
                    None,
                ),
                Verdict::Skip(SkipReason::NotSelected(r)) => (
                    Act::Skip {
                        reason: r,
                        returned: false,
                    },
                    None,
                ),
                Verdict::Poison(r) => (Act::Quarantine(r), None),
                Verdict::Replay { key, destination } => match hold(
                    &self.proven,
                    &mut self.unproven,
                    &self.replay.spec.canary.signature_header,
                    props,
                ) {
                    Some(reason) => (
                        Act::Skip {
                            reason,
                            returned: false,
                        },
                        None,
                    ),
                    None => (Act::Replay(destination), key),
                },
            };
            if !matches!(act, Act::Skip { .. }) {
                self.selected += 1;
            }
            items.push(Item {
                delivery,
                identity,
                fingerprint,
                digest,
                key,
                act,
            });
        }
        items
    }

    fn report(&mut self, progress: &Progress) {
        let left = self.bound.saturating_sub(self.seen);
        self.status.message = Some(format!("replaying, {left} left of this pass"));
        progress.send_replace(self.status.clone());
    }

    /// Close the pass: everything still unacked goes back to the queue in place.
    pub(super) async fn finish(&mut self, end: End) -> DlqReplayStatus {
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

/// Why a replayable message stays in the queue (its signature's canary did not pass, or none
/// met it), counting the unproven ones in `unproven` for the end message.
fn hold(
    proven: &proven::Proven,
    unproven: &mut std::collections::BTreeMap<String, u64>,
    signature_header: &str,
    props: &lapin::BasicProperties,
) -> Option<String> {
    if let proven::Proven::All = proven {
        return None;
    }
    let sig = classify::signature(signature_header, props);
    let hold = proven.hold(&sig)?;
    let reason = hold.reason(&sig);
    if hold == proven::Hold::Unproven {
        *unproven.entry(sig).or_default() += 1;
    }
    Some(reason)
}
