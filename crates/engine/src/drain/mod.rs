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
//!
//! With the canary on, a replayable message whose signature's canary is still out is set aside
//! (held unacknowledged, out of the window) and released into a later step when the verdict is
//! in ([`crate::canary`]).
//!
//! By file: `admit` (what the next step takes, and sending it), `decide` (what each delivery
//! becomes), `gate`, `send`, `settle` (keep, record, ack),
//! `aside` (the canary's part: set aside, release, look) and `end` (how a pass ends); this one
//! runs the steps.

mod admit;
mod aside;
mod decide;
mod end;
mod gate;
mod send;
mod settle;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::amqp::Delivery;
use crate::amqp::{Confirm, Connection};
use governor::DefaultDirectRateLimiter;
use tokio_util::sync::CancellationToken;

use super::classify::Destination;
use super::source::{self, Source};
use super::store::{self, Store};
use super::{keep, publish, watch, Options, Progress, Replay};
use crate::canary::Tracker;
use crate::status::ReplayStatus;
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
    /// Set aside until its signature's canary has a verdict (the signature), or, read in the
    /// first look-ahead, until that is decided (`None`). Leaves the step unacked.
    Aside(Option<String>),
}

/// A delivery set aside: held unacknowledged until it can be decided.
pub(super) struct Aside {
    delivery: Delivery,
    /// Its signature's canary is out; `None`: read in the first look-ahead.
    signature: Option<String>,
    /// Its move-ledger meeting, made when it was fresh.
    met: Option<(String, bool)>,
    /// When it was set aside.
    since: tokio::time::Instant,
}

impl Aside {
    /// Set aside for [`decide::HOLD_MAX`]: it is left in the queue (moved to the tail).
    fn overdue(&self) -> bool {
        self.since.elapsed() >= decide::HOLD_MAX
    }
}

pub(super) struct Item {
    delivery: Delivery,
    /// The move ledger's digest, computed when needed (a kept or a leftover message).
    digest: Option<String>,
    /// What audit rows call the message (message id or body hash).
    identity: String,
    /// What the settled marks call it: a hash of message id and body.
    fingerprint: String,
    /// Its failure signature, for its audit row.
    signature: String,
    key: Option<String>,
    act: Act,
    /// The first message of its signature: the canary.
    canary: bool,
    /// Its move-ledger meeting (kept for a delivery set aside).
    met: Option<(String, bool)>,
}

pub(super) enum End {
    Drained,
    TooManyReturns(u64, String),
    Cancelled,
    /// A check before (or, for the signatures, during) the drain says stop: `Failed`, why.
    Refused(String),
    /// A canary did not pass and the replay stops ([`crate::canary::Tracker::stop`]).
    CanaryFailed(String),
    /// The queue a canary would land on failed its pre-flight (why, which queues): the pass
    /// ends, handing back what it holds, and waits for the checks to pass.
    Pending(String, Vec<String>),
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
    confirms: Vec<(usize, Confirm)>,
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
    /// Where quarantined messages go: the quarantine queue, through the default exchange.
    quarantine: Destination,
    pub(super) store: Store,
    /// The same connection, for the next step's lookup while a step's commit is on its way.
    gate_store: Store,
    limiter: Option<DefaultDirectRateLimiter>,
    status: ReplayStatus,
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
    /// The signatures and their canaries.
    pub(super) canary: Tracker,
    /// Deliveries set aside, by delivery tag.
    aside: BTreeMap<u64, Aside>,
    /// Set-aside deliveries whose wait is over, in order, for the next steps.
    released: VecDeque<Aside>,
    /// A verdict came in: look for set-aside deliveries to release.
    release_due: bool,
    /// The first look-ahead found nothing more to read.
    opening_idle: bool,
    /// A signature past `canary.maxSignatures` was met, or a `spec.expect` maximum reached:
    /// the pass ends (why).
    refused: Option<String>,
    /// Replays and quarantines published (or on their way) by this replay, this pass's
    /// included, for `spec.expect`'s maximums.
    published: (u64, u64),
    /// Landing queues that passed their pre-flight in this pass.
    checked: HashMap<String, tokio::time::Instant>,
    last_look: Option<tokio::time::Instant>,
    last_recheck: Option<tokio::time::Instant>,
    last_overdue_check: Option<tokio::time::Instant>,
    /// The canaries' revision the status shows, and when the last of their waits ends there
    /// (HH:MM:SS UTC).
    shown_revision: u64,
    wait_until: String,
    /// The first look-ahead's pre-flight failed: since when, and what the status says.
    pending_since: Option<tokio::time::Instant>,
    pending_note: Option<String>,
    /// The source connection (the return watch's queue is its own).
    pub(super) src_conn: Option<Arc<Connection>>,
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
        status: ReplayStatus,
        bound: u64,
        (window, step): (usize, usize),
    ) -> Self {
        Self {
            replay,
            replay_id: state.replay_id.clone(),
            claim_value: store::claim_value(&state.replay_id, state.attempt),
            source: Some(source),
            publisher,
            quarantine: Destination {
                exchange: String::new(),
                routing_key: replay.spec.quarantine.queue.clone(),
            },
            gate_store: store.clone(),
            store,
            limiter: crate::pass::limiter(&replay.spec),
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
            canary: Tracker::new(&replay.spec.canary, Vec::new()),
            aside: BTreeMap::new(),
            released: VecDeque::new(),
            release_due: false,
            opening_idle: false,
            refused: None,
            published: (state.counts.replayed, state.counts.quarantined),
            checked: HashMap::new(),
            last_look: None,
            last_recheck: None,
            last_overdue_check: None,
            shown_revision: 0,
            wait_until: String::new(),
            pending_since: None,
            pending_note: None,
            src_conn: None,
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
            let idle = flights.is_empty() && self.pending.is_empty();
            match self.canary_turn(opts, progress, idle).await {
                Ok(Some(end)) => break end,
                Ok(None) => {}
                Err(e) => break End::Error(e),
            }
            let busy = flights.iter().map(Flight::len).sum();
            // Never wait for deliveries while a step's confirms (or a move's) may be ready.
            let wait = if idle { opts.idle } else { Duration::ZERO };
            let next = match self.next_inputs(busy, false, wait, cancel).await {
                Ok(n) => n,
                Err(e) => break End::Error(e),
            };
            if let Some((inputs, fresh)) = next {
                if !inputs.is_empty() {
                    stalled = Duration::ZERO;
                    match self.admit(inputs, fresh).await {
                        Ok(f) => flights.extend(f),
                        Err((f, e)) => {
                            flights.extend(f);
                            break End::Error(e);
                        }
                    }
                    continue;
                }
                if idle && self.canary.opening() {
                    // Nothing more to read now: the first look-ahead is what there is.
                    self.opening_idle = true;
                    continue;
                }
                if idle && !self.canary_holds() {
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
                if idle {
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
                if cancel.is_cancelled() {
                    break End::Cancelled;
                }
                if self.canary_holds() {
                    // Waiting for the canaries: look again in a moment.
                    self.report(progress);
                    tokio::select! {
                        _ = tokio::time::sleep(opts.look) => {}
                        _ = cancel.cancelled() => {}
                    }
                    continue;
                }
                break End::Drained;
            };
            let items = self.confirmed(flight).await;
            // The next step, if it may follow once this one has landed, is admitted with it.
            let busy = flights.iter().map(Flight::len).sum();
            let next = match self.next_inputs(busy, true, Duration::ZERO, cancel).await {
                Ok(next) => next.filter(|(n, _)| !n.is_empty()),
                Err(e) => {
                    if let Err(e) = self.settle(items).await {
                        tracing::debug!(error = %e, "landing a step after the pass ended");
                    }
                    break End::Error(e);
                }
            };
            match next {
                None => {
                    if let Err(e) = self.settle(items).await {
                        break End::Error(e);
                    }
                }
                Some((inputs, fresh)) => {
                    let (landed, admitted) = self.settle_and_admit(items, inputs, fresh).await;
                    let admitted = match admitted {
                        Ok(f) => {
                            flights.extend(f);
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

    /// Whether both of the pass's broker connections are still up (an error on a channel can be
    /// the echo of a connection that went away).
    pub(super) fn connected(&self, src_conn: &Connection) -> bool {
        src_conn.is_open() && self.publisher.connection().is_open()
    }
}
