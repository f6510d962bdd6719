//! One pass of a replay, flowing one way: its context is opened once ([`Pass::open`]:
//! connections, the store and the replay's state, the publisher), then the drain runs over it
//! ([`Pass::drain`], which opens the queue's consumer, the mover, the move ledger, the known
//! dead-letter routes and the canaries' return watch once; the canaries go inside the drain, see
//! [`crate::canary`]), then the finish ([`Drained::finish`]). A first run, a rerun and a
//! reconnect all start a new pass, which resumes from the state in Redis; so does a pass that
//! ended `Pending` once its checks pass ([`pending_wait`]).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use crate::amqp::{Connection, FieldTable, QueueDeclare};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tokio_util::sync::CancellationToken;

use crate::canary::{self, Tracker};
use crate::drain::{Drain, End};
use crate::preflight::{audit_config, redis_preflight};
use crate::source::{self, Source};
use crate::spec::DlqReplaySpec;
use crate::status::{AuditRef, CanaryStatus, Phase, ReplayStatus};
use crate::store::{self, Store};
use crate::{amqp_user, connect_amqp, keep, now, publish, watch};
use crate::{Error, Options, Progress, Replay};

/// How a pass ended.
pub(crate) enum PassEnd {
    /// The replay reached a phase that stands (Done, Failed, CanaryFailed, Suspended, Pending).
    Ended(ReplayStatus),
    /// A connection went away: the status so far, and why.
    Lost(ReplayStatus, String),
    /// A canary's landing queue failed its pre-flight (these queues): wait for it.
    Pending(ReplayStatus, Vec<String>),
    /// The pass ended `Pending` and its checks pass now: start another at once.
    Again(ReplayStatus),
}

/// What the stages of a pass share, opened once.
pub(crate) struct Pass<'a> {
    pub replay: &'a Replay,
    pub opts: &'a Options,
    pub progress: &'a Progress,
    pub cancel: &'a CancellationToken,
    /// The source connection: the dead-letter queue's consumer, the canaries' watch, queue
    /// depths and declarations (shared with the pass's end, which closes it).
    pub conn: Arc<Connection>,
    /// Confirmed publishes on a connection of their own.
    pub publisher: publish::Publisher,
    pub store: Store,
    /// The replay's state as Redis held it when the pass began.
    pub state: store::State,
    pub status: ReplayStatus,
    /// How long the pass waits for other consumers to leave the dead-letter queue (see
    /// [`unshared_depth`]).
    pub others_grace: Duration,
}

/// What opening a pass found.
pub(crate) enum Opened<'a> {
    /// The replay had ended already (its final status is stored): nothing to do.
    Ended(ReplayStatus),
    Ready(Box<Pass<'a>>),
    /// A connection went away once the replay's state was loaded: worth another pass.
    Lost(ReplayStatus, String),
}

impl<'a> Pass<'a> {
    /// Connect, check the Redis, load (or begin) the replay's state, declare the quarantine and
    /// open the publisher. Errors here come before anything is touched. `after`: the pass
    /// follows one of this run, whose connections are gone (see [`OTHERS_GRACE`]).
    pub(crate) async fn open(
        replay: &'a Replay,
        opts: &'a Options,
        progress: &'a Progress,
        cancel: &'a CancellationToken,
        after: bool,
    ) -> Result<Opened<'a>, Error> {
        let conn = connect_amqp(&replay.amqp_url, &replay.connection_name("source")).await?;
        let (depth, _) = source_state(&conn, &replay.spec.source.queue).await?;
        let mut con = store::connect(&replay.redis_url).await?;
        let eviction_risk = redis_preflight(replay, &mut con, depth.into()).await?;
        let (mut store, state) = Store::begin(
            con,
            &replay.namespace,
            &replay.state_name(),
            depth.into(),
            &now(),
            &audit_config(&replay.spec),
        )
        .await?;
        // A batch whose publishes are confirmed is worth waiting for Redis: as long as a lost
        // connection would be.
        store.retry_for(opts.reconnect);
        store.report_waits_to(progress.clone());
        // A stop (suspend, delete, shutdown) ends the waits between Redis retries.
        store.stop_on(cancel.clone());
        if let Some(done) = &state.final_status {
            let status: ReplayStatus = serde_json::from_str(done)
                .map_err(|e| Error::Redis(format!("stored final status is unreadable: {e}")))?;
            let _ = conn.close(200, "done").await;
            return Ok(Opened::Ended(status));
        }
        let mut status = initial_status(&state, store.keys().audit.clone());
        status.redis_eviction_risk = eviction_risk;
        if let Some(a) = status.audit.as_mut() {
            a.sink = replay.spec.audit_sink();
        }
        let opened = async {
            declare_quarantine(&conn, &replay.spec.quarantine.queue).await?;
            let pub_conn =
                connect_amqp(&replay.amqp_url, &replay.connection_name("publish")).await?;
            publish::Publisher::open(pub_conn, &amqp_user(&replay.amqp_url)).await
        };
        let publisher = match opened.await {
            Ok(p) => p,
            Err(e) => {
                let _ = conn.close(200, "done").await;
                // The replay has begun: a lost connection from here on is worth another pass.
                if e.is_transient() {
                    return Ok(Opened::Lost(status, e.to_string()));
                }
                return Err(e);
            }
        };
        Ok(Opened::Ready(Box::new(Pass {
            replay,
            opts,
            progress,
            cancel,
            conn: Arc::new(conn),
            publisher,
            store,
            state,
            status,
            others_grace: if after { Duration::ZERO } else { OTHERS_GRACE },
        })))
    }

    /// The drain, then the finish. The source connection is closed at the end whatever
    /// happened (everything unsettled, and everything set aside, goes back to the queue); a
    /// pass that ended `Pending` then waits for its checks.
    pub(crate) async fn run(self) -> Result<PassEnd, Error> {
        let conn = self.conn.clone();
        let (replay, opts, progress, cancel) = (self.replay, self.opts, self.progress, self.cancel);
        let end = match self.drain().await {
            Ok(drained) => drained.finish().await,
            Err(e) => Err(e),
        };
        let end = match end {
            Ok(PassEnd::Pending(status, queues)) => {
                pending_wait(&conn, replay, opts, progress, cancel, status, &queues).await
            }
            other => other,
        };
        let _ = conn.close(200, "done").await;
        end
    }

    /// What the drain needs is opened once (the canaries' verdicts stored by earlier passes
    /// included), then the drain runs to its end.
    async fn drain(self) -> Result<Drained<'a>, Error> {
        let Pass {
            replay,
            opts,
            progress,
            cancel,
            conn,
            publisher,
            store,
            state,
            mut status,
            others_grace,
        } = self;
        let stored: Vec<CanaryStatus> = match &state.canary {
            Some(json) => serde_json::from_str(json)
                .map_err(|e| Error::Redis(format!("stored canary results: {e}")))?,
            None => Vec::new(),
        };
        let tracker = Tracker::new(&replay.spec.canary, stored);
        status.canary = tracker.status();
        let queue = &replay.spec.source.queue;
        let depth = unshared_depth(&conn, queue, progress, &status, others_grace, cancel).await?;
        status.phase = Some(if tracker.enabled() {
            Phase::Pending
        } else {
            Phase::Draining
        });
        status.message = Some(format!("replaying, {depth} messages in the queue"));
        progress.send_replace(status.clone());

        let window = opts.window.max(1);
        let step = step_size(&replay.spec, window);
        let queue = &replay.spec.source.queue;
        // Set-aside deliveries take prefetch too.
        let credit = (usize::from(prefetch(window)) + tracker.look_ahead()).min(65535) as u16;
        let src = Source::open(&conn, queue, credit, depth.into()).await?;
        let mover = keep::Mover::open(publisher.connection(), publisher.user(), queue).await?;
        let ledger = keep::Ledger::open(store.redis(), &replay.amqp_url, queue).await?;
        let mut drain = Drain::new(
            replay,
            &state,
            src,
            publisher,
            store,
            status,
            depth.into(),
            (window, step),
        );
        drain.keeper = Some((mover, ledger));
        drain.canary = tracker;
        drain.cancel = cancel.clone();
        drain.src_conn = Some(conn.clone());
        if replay.spec.canary.enabled {
            let mut redis = drain.store.redis();
            drain.routes = watch::known(&mut redis, &replay.amqp_url, queue).await?;
            drain.returns = Some(watch::Returns::open(&conn, &drain.routes).await?);
        }
        let end = drain.run(opts, progress, cancel).await;
        Ok(Drained {
            replay,
            conn,
            drain,
            end,
        })
    }
}

/// A drain that ran to its end, and how it ended.
pub(crate) struct Drained<'a> {
    replay: &'a Replay,
    conn: Arc<Connection>,
    drain: Drain<'a>,
    end: End,
}

impl Drained<'_> {
    /// Settle what the drain leaves behind (the move ledger, the routes learnt, the returns
    /// watch), write the final status, and say whether the pass ended or lost a connection.
    async fn finish(self) -> Result<PassEnd, Error> {
        let Drained {
            replay,
            conn,
            mut drain,
            end,
        } = self;
        let queue = &replay.spec.source.queue;
        if let End::Drained = end {
            // Every message the pass began with was met: the ledger's doubts about them are
            // settled.
            if let Some((_, ledger)) = drain.keeper.as_mut() {
                if let Err(e) = ledger.resolved().await {
                    tracing::warn!(error = %e, "settling the move ledger");
                }
            }
        }
        let mut redis = drain.store.redis();
        if let Err(e) = watch::learn(&mut redis, &replay.amqp_url, queue, &drain.routes).await {
            tracing::warn!(error = %e, "remembering the dead-letter routes");
        }
        if let Some(r) = drain.returns.take() {
            r.close().await;
        }
        let pending = match &end {
            End::Pending(_, queues) => Some(queues.clone()),
            _ => None,
        };
        let lost = match &end {
            End::Error(e) if e.is_transient() => Some(e.to_string()),
            End::Error(e) if !drain.connected(&conn) => Some(format!("connection lost: {e}")),
            _ => None,
        };
        let mut status = drain.finish(end).await;
        if let Some(queues) = pending {
            return Ok(PassEnd::Pending(status, queues));
        }
        if let Some(why) = lost {
            // Not a phase: the next pass picks the drain up where this one left it.
            status.phase = Some(Phase::Draining);
            return Ok(PassEnd::Lost(status, why));
        }
        let done = status.phase == Some(Phase::Done);
        if done || status.phase == Some(Phase::CanaryFailed) {
            // A CanaryFailed verdict is final and stored like Done (its settled marks kept, for
            // a retry in place).
            if let Ok(json) = serde_json::to_string(&status) {
                if let Err(e) = drain.store.finish(&json, done).await {
                    if e.is_transient() {
                        return Ok(PassEnd::Lost(status, e.to_string()));
                    }
                    status.phase = Some(Phase::Failed);
                    status.message = Some(format!("could not record the final status: {e}"));
                }
            }
        }
        Ok(PassEnd::Ended(status))
    }
}

/// A pass that ended `Pending` (a canary's landing queue failed its pre-flight; what it held
/// went back to the queue): only the cheap checks run, every `opts.recheck`, until they pass
/// (another pass starts) or the replay is stopped or gives up waiting.
async fn pending_wait(
    conn: &Connection,
    replay: &Replay,
    opts: &Options,
    progress: &Progress,
    cancel: &CancellationToken,
    mut status: ReplayStatus,
    queues: &[String],
) -> Result<PassEnd, Error> {
    let started = tokio::time::Instant::now();
    let mut why = status.message.clone().unwrap_or_default();
    loop {
        status.phase = Some(Phase::Pending);
        status.message = Some(format!(
            "{why}; checking again every {}s",
            opts.recheck.as_secs()
        ));
        progress.send_replace(status.clone());
        let timed_out = opts.pending_timeout.is_some_and(|t| started.elapsed() >= t);
        if timed_out || cancel.is_cancelled() {
            let touched = if status.counts.scanned == 0 {
                ", nothing was touched"
            } else {
                ""
            };
            status.message = Some(format!("still Pending ({why}); gave up waiting{touched}"));
            return Ok(PassEnd::Ended(status));
        }
        tokio::select! {
            _ = tokio::time::sleep(opts.recheck) => {}
            _ = cancel.cancelled() => {}
        }
        match canary::preflight(conn, &replay.spec, queues).await? {
            Some(still) => why = still,
            None => return Ok(PassEnd::Again(status)),
        }
    }
}

/// How many messages the dead-letter queue holds now, and its consumers; a missing queue is
/// refused.
async fn source_state(conn: &Connection, queue: &str) -> Result<(u32, u32), Error> {
    source::queue_state(conn, queue)
        .await?
        .ok_or_else(|| Error::SourceMissing(queue.into()))
}

/// How long a run's first pass waits for other consumers to leave the dead-letter queue before
/// it takes its bound all the same (see [`unshared_depth`]). The broker closes a killed
/// process's connection within milliseconds; a consumer whose node went down stays listed
/// until the node is back (RabbitMQ 4.0 quorum queues, measured: 30 s and more, its messages
/// returned at once), and one cut off without a reset until its heartbeat times out, which no
/// short wait covers. So a pass that follows one of the same run (a reconnect: its old
/// connection is gone, or its messages were returned) does not wait: a wait there only delayed
/// the drain through another node after its node's kill -9 (0.4 s to 3.7 s).
const OTHERS_GRACE: Duration = Duration::from_secs(3);

/// How often the grace looks again.
const OTHERS_LOOK: Duration = Duration::from_millis(20);

/// The dead-letter queue's depth, the pass's bound, once no other consumer is on it or the
/// `grace` is over (the status says why it waits meanwhile).
///
/// Another consumer on the queue is most often this replay's own previous run, killed, whose
/// connection the broker has not closed yet: the messages it holds unacked are not in the depth
/// and come back to the queue after the pass took its bound, so the pass would end `Done` with
/// as many left in the queue (measured on a 3.10 quorum queue, 2 ms after a kill -9 of a consumer
/// holding 5 of 10: 5 ready and 1 consumer; 0.4 ms later, 10 and none).
async fn unshared_depth(
    conn: &Connection,
    queue: &str,
    progress: &Progress,
    status: &ReplayStatus,
    grace: Duration,
    cancel: &CancellationToken,
) -> Result<u32, Error> {
    let until = tokio::time::Instant::now() + grace;
    let mut shown = false;
    loop {
        let (depth, consumers) = source_state(conn, queue).await?;
        if consumers == 0 {
            return Ok(depth);
        }
        if tokio::time::Instant::now() >= until || cancel.is_cancelled() {
            tracing::warn!(
                queue,
                consumers,
                depth,
                "other consumers on the dead-letter queue: the messages they hold unacked are not in this pass"
            );
            return Ok(depth);
        }
        if !shown {
            shown = true;
            let mut waiting = status.clone();
            waiting.phase = Some(Phase::Pending);
            waiting.message = Some(format!(
                "OtherConsumers: waiting up to {}s for the {consumers} other consumer(s) of the dead-letter queue {queue:?} to go (a previous run's connection the broker has not closed yet, or another application): the messages they hold unacked are not in the queue's count",
                grace.as_secs()
            ));
            progress.send_replace(waiting);
        }
        tokio::select! {
            _ = tokio::time::sleep(OTHERS_LOOK) => {}
            _ = cancel.cancelled() => {}
        }
    }
}

async fn declare_quarantine(conn: &Connection, queue: &str) -> Result<(), Error> {
    if source::queue_state(conn, queue).await?.is_some() {
        return Ok(());
    }
    let ch = conn.create_channel().await?;
    let durable = QueueDeclare {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue, durable, FieldTable::default())
        .await?;
    let _ = ch.close(200, "ok").await;
    Ok(())
}

fn initial_status(state: &store::State, audit_key: String) -> ReplayStatus {
    ReplayStatus {
        phase: Some(Phase::Pending),
        replay_id: Some(state.replay_id.clone()),
        source_depth_at_start: Some(state.depth_at_start),
        counts: state.counts,
        audit: Some(AuditRef {
            key: audit_key,
            records: state.records,
            ..AuditRef::default()
        }),
        started_at: Some(state.started_at.clone()),
        ..Default::default()
    }
}

/// Deliveries per step: half the window, so two steps are in flight (one landing while the
/// other's publishes are confirmed; measured faster than four smaller steps at the same
/// window). With a rate limit, at most about a tenth of a second of messages, so the status
/// follows the rate.
fn step_size(spec: &DlqReplaySpec, window: usize) -> usize {
    let step = (window / 2).max(1);
    match &spec.rate {
        Some(r) => ((r.messages_per_second / 10) as usize).clamp(1, step),
        None => step,
    }
}

/// The consumer's prefetch: deliveries wait in the client ahead of the window (at no risk: not
/// decided, they go back untouched on a crash), so a step never waits for the broker. The
/// pass's last `prefetch` messages come by basic.get (see [`source::Source::open`]), which
/// bounds it.
fn prefetch(window: usize) -> u16 {
    (window * 8).clamp(64, 1024) as u16
}

/// The drain's rate limiter (`spec.rate`).
pub(crate) fn limiter(spec: &DlqReplaySpec) -> Option<DefaultDirectRateLimiter> {
    let rate = spec.rate.as_ref()?;
    let per_second = NonZeroU32::new(rate.messages_per_second)?;
    // Default burst: a twentieth of a second's worth, so no second sees much more than the rate.
    let burst = rate.burst.unwrap_or((rate.messages_per_second / 20).max(1));
    let burst = NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN);
    Some(RateLimiter::direct(
        Quota::per_second(per_second).allow_burst(burst),
    ))
}
