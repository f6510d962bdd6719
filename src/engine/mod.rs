//! The replay engine: one decision per message, nothing acked before its outcome is durable.
//!
//! No Kubernetes in here: the CLI and the controller both hand the engine a [`Replay`] (a spec
//! plus resolved URLs) and watch its [`Progress`].

pub mod canary;
pub mod classify;
pub mod keep;
pub mod key;
pub mod message;
pub mod plan;
pub mod publish;
pub mod scan;
pub mod source;
pub mod store;
pub mod watch;

use std::num::NonZeroU32;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use lapin::message::Delivery;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use crate::api::{AuditRef, Counts, DlqReplaySpec, DlqReplayStatus, IdempotencyMode, Phase};
use crate::Error;
use classify::{Destination, Rules, SkipReason, Verdict};
use source::Source;
use store::{AuditRow, Store};

/// A replay ready to run: its spec and the URLs its secrets resolved to.
#[derive(Clone, Debug)]
pub struct Replay {
    /// The namespace (`default` for manifests without one).
    pub namespace: String,
    /// The name: together with the namespace it identifies the replay across runs.
    pub name: String,
    /// What to do.
    pub spec: DlqReplaySpec,
    /// The broker URL.
    pub amqp_url: String,
    /// The Redis URL (audit trail, replay state, idempotency keys).
    pub redis_url: String,
    /// The resource's uid when a cluster runs it: a DlqReplay deleted and created again under
    /// the same name is a new replay, not the finished old one.
    pub uid: Option<String>,
}

impl Replay {
    /// The name its state is kept under: `name`, or `name@uid` in a cluster.
    pub fn state_name(&self) -> String {
        match &self.uid {
            Some(uid) => format!("{}@{uid}", self.name),
            None => self.name.clone(),
        }
    }

    /// The broker connection name for one of its connections (`source`, `publish`, `plan`), so
    /// that `rabbitmqctl list_connections` shows whose it is.
    pub fn connection_name(&self, role: &str) -> String {
        format!("dlq-replay {}/{} {role}", self.namespace, self.name)
    }
}

/// Knobs that are not part of the spec.
#[derive(Clone, Debug)]
pub struct Options {
    /// Messages decided together: the in-flight window, and so the most a crash can leave
    /// unknown.
    pub batch: usize,
    /// How long to wait for a delivery before looking at the queue again.
    pub idle: Duration,
    /// How long the queue may hold messages without delivering any before the replay gives up.
    pub stall: Duration,
    /// How long a replay may stay `Pending` before `run` gives up (`None`: forever).
    pub pending_timeout: Option<Duration>,
    /// How often a `Pending` replay checks again.
    pub recheck: Duration,
    /// How often the canary watch looks for returns.
    pub look: Duration,
    /// How often a draining replay looks for its own messages coming back.
    pub return_check: Duration,
    /// How long a replay that lost its broker or Redis connection keeps trying to reconnect
    /// (with backoff) before it ends `Failed`, and how long a Redis call whose answer was lost
    /// is asked again with the batch held; zero: it ends at the first loss.
    pub reconnect: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            batch: 256,
            idle: Duration::from_millis(500),
            stall: Duration::from_secs(30),
            pending_timeout: None,
            recheck: Duration::from_secs(5),
            look: Duration::from_millis(250),
            return_check: Duration::from_secs(1),
            reconnect: Duration::from_secs(60),
        }
    }
}

/// Where the engine publishes its status as it goes.
pub type Progress = tokio::sync::watch::Sender<DlqReplayStatus>;

/// A timestamp in the form status and audit rows use.
pub fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// The AMQP user of a URL (what `user-id` must equal), `guest` when absent.
pub fn amqp_user(url: &str) -> String {
    url::Url::parse(url)
        .ok()
        .map(|u| u.username().to_string())
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "guest".into())
}

/// Connect to the broker with a connection name that says who we are (so an operator can find,
/// or close, our connections in `rabbitmqctl list_connections`).
pub async fn connect_amqp(url: &str, name: &str) -> Result<Connection, Error> {
    crate::tls::install_provider();
    let props = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(url, props).await.map_err(|e| {
        let why = crate::tls::hint(format!(
            "cannot connect: {}",
            crate::redact::error(&e.to_string(), url)
        ));
        // Refused or reset (a broker restarting) is worth another try; a refused login is not.
        if crate::broker_connection_lost(&e) {
            Error::Connection(format!("broker: {why}"))
        } else {
            Error::Broker(why)
        }
    })
}

/// Run a replay to its end (or until `cancel`), publishing status on `progress`.
///
/// Errors before the first message is touched (unreachable broker or Redis, missing source
/// queue) are returned as `Err`; a failure mid-run ends the replay in phase `Failed`, with
/// everything not settled still in the dead-letter queue.
///
/// A connection lost mid-run (broker restart, `rabbitmqctl close_connection`, Redis gone) is
/// not the end: the pass closes what is left of its connections (everything unsettled goes
/// back to the queue), waits with exponential backoff and starts a new pass of the same replay,
/// which resumes it as a rerun would, for up to [`Options::reconnect`].
pub async fn run(
    replay: &Replay,
    opts: &Options,
    progress: &Progress,
    cancel: &CancellationToken,
) -> Result<DlqReplayStatus, Error> {
    if replay.spec.dry_run {
        let report = plan::plan(replay).await?;
        let status = report.status();
        progress.send_replace(status.clone());
        return Ok(status);
    }
    let mut lost_since: Option<tokio::time::Instant> = None;
    let mut delays = reconnect_delays();
    let mut last = progress.borrow().clone();
    loop {
        let why = match run_pass(replay, opts, progress, cancel).await {
            Ok(Pass::Ended(status)) => return Ok(status),
            Ok(Pass::Lost(status, why)) => {
                // A pass that settled something had its connections back: the next loss gets
                // the whole budget again.
                if status.counts.scanned > last.counts.scanned {
                    lost_since = None;
                    delays = reconnect_delays();
                }
                last = status;
                why
            }
            // A first pass that cannot start is a configuration problem: say so at once.
            Err(e) if lost_since.is_none() || !e.is_transient() => return Err(e),
            Err(e) => e.to_string(),
        };
        let since = *lost_since.get_or_insert_with(tokio::time::Instant::now);
        let delay = delays.next().unwrap_or(RECONNECT_MAX_DELAY);
        if cancel.is_cancelled() {
            last.phase = Some(Phase::Suspended);
            last.message = Some(format!(
                "stopped while reconnecting ({why}); run it again to resume"
            ));
            progress.send_replace(last.clone());
            return Ok(last);
        }
        if since.elapsed() + delay > opts.reconnect {
            let status = gave_up(last, &why, opts.reconnect);
            progress.send_replace(status.clone());
            return Ok(status);
        }
        crate::metrics::Metrics::global().retried("reconnect");
        tracing::warn!(replay = %replay.name, error = %why, delay_ms = delay.as_millis() as u64, "connection lost; reconnecting");
        let mut waiting = last.clone();
        waiting.message = Some(format!(
            "{why}; reconnecting in {:.1}s (giving up {}s after the loss)",
            delay.as_secs_f64(),
            opts.reconnect.as_secs()
        ));
        progress.send_replace(waiting);
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = cancel.cancelled() => {}
        }
    }
}

const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(8);

/// 0.25 s, 0.5 s, 1 s … capped at 8 s, with jitter so that replicas do not reconnect in step.
fn reconnect_delays() -> impl Iterator<Item = Duration> {
    backoff(RECONNECT_MAX_DELAY)
}

/// 0.25 s doubling up to `max`, with jitter, without end.
pub(crate) fn backoff(max: Duration) -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}

fn gave_up(mut status: DlqReplayStatus, why: &str, budget: Duration) -> DlqReplayStatus {
    status.phase = Some(Phase::Failed);
    status.message = Some(format!(
        "{why}; gave up reconnecting after {}s; unsettled messages are still in the dead-letter queue; run it again to resume",
        budget.as_secs()
    ));
    status
}

/// How a pass ended.
enum Pass {
    /// The replay reached a phase that stands (Done, Failed, CanaryFailed, Suspended, Pending).
    Ended(DlqReplayStatus),
    /// A connection went away: the status so far, and why.
    Lost(DlqReplayStatus, String),
}

/// One pass over the queue on fresh connections: a first run, a rerun and a reconnect all start
/// here and resume from the state in Redis.
async fn run_pass(
    replay: &Replay,
    opts: &Options,
    progress: &Progress,
    cancel: &CancellationToken,
) -> Result<Pass, Error> {
    let src_conn = connect_amqp(&replay.amqp_url, &replay.connection_name("source")).await?;
    let depth = source::queue_state(&src_conn, &replay.spec.source.queue)
        .await?
        .ok_or_else(|| Error::SourceMissing(replay.spec.source.queue.clone()))?
        .0;
    let con = store::connect(&replay.redis_url).await?;
    let (mut store, state) = Store::begin(
        con,
        &replay.namespace,
        &replay.state_name(),
        depth.into(),
        &now(),
    )
    .await?;
    // A batch whose publishes are confirmed is worth waiting for Redis: as long as a lost
    // connection would be.
    store.retry_for(opts.reconnect);
    store.report_waits_to(progress.clone());
    // A stop (suspend, delete, shutdown) ends the waits between Redis retries (see Store::stop_on).
    store.stop_on(cancel.clone());
    if let Some(done) = &state.final_status {
        let status: DlqReplayStatus = serde_json::from_str(done)
            .map_err(|e| Error::Redis(format!("stored final status is unreadable: {e}")))?;
        progress.send_replace(status.clone());
        let _ = src_conn.close(200, "done".into()).await;
        return Ok(Pass::Ended(status));
    }
    let status = initial_status(&state, store.keys().audit.clone());
    let res = replay_pass(
        replay, opts, progress, cancel, &src_conn, state, store, status,
    )
    .await;
    let _ = src_conn.close(200, "done".into()).await;
    let pass = match res {
        Ok(pass) => pass,
        // The replay has begun: a lost connection from here on is worth another pass.
        Err(e) if e.is_transient() => Pass::Lost(progress.borrow().clone(), e.to_string()),
        Err(e) => return Err(e),
    };
    if let Pass::Ended(status) = &pass {
        progress.send_replace(status.clone());
    }
    Ok(pass)
}

/// The pass once its state is loaded: canaries (unless already decided), then the drain.
#[allow(clippy::too_many_arguments)]
async fn replay_pass(
    replay: &Replay,
    opts: &Options,
    progress: &Progress,
    cancel: &CancellationToken,
    src_conn: &Connection,
    state: store::State,
    mut store: Store,
    mut status: DlqReplayStatus,
) -> Result<Pass, Error> {
    declare_quarantine(src_conn, &replay.spec.quarantine.queue).await?;
    let pub_conn = connect_amqp(&replay.amqp_url, &replay.connection_name("publish")).await?;
    let mut publisher = publish::Publisher::open(pub_conn, &amqp_user(&replay.amqp_url)).await?;
    let phase = canary_phase(
        replay,
        opts,
        progress,
        cancel,
        src_conn,
        &state,
        &mut publisher,
        &mut store,
        &mut status,
    )
    .await;
    let held = match phase {
        Ok(CanaryEnd::Drain(held)) => held,
        Ok(CanaryEnd::Stop) => {
            if status.phase == Some(Phase::CanaryFailed) {
                status.finished_at = Some(now());
                if let Ok(json) = serde_json::to_string(&status) {
                    store.finish(&json).await?;
                }
            }
            return Ok(Pass::Ended(status));
        }
        Err(e) if e.is_transient() => return Ok(Pass::Lost(status, e.to_string())),
        Err(e) => {
            status.phase = Some(Phase::Failed);
            status.message = Some(format!(
                "{e}; nothing else was replayed; run it again to resume"
            ));
            return Ok(Pass::Ended(status));
        }
    };
    // The canaries (and what came back) changed the queue: the drain's bound is what it holds now.
    let depth = source::queue_state(src_conn, &replay.spec.source.queue)
        .await?
        .ok_or_else(|| Error::SourceMissing(replay.spec.source.queue.clone()))?
        .0;
    status.phase = Some(Phase::Draining);
    status.message = Some(format!("replaying, {depth} messages in the queue"));
    progress.send_replace(status.clone());

    let batch = batch_size(&replay.spec, opts.batch);
    let window = (batch * 2).min(u16::MAX as usize) as u16;
    let queue = &replay.spec.source.queue;
    let src = Source::open(src_conn, queue, window, depth.into()).await?;
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
        batch,
    );
    drain.keeper = Some((mover, ledger));
    drain.held_back = held;
    drain.cancel = cancel.clone();
    if replay.spec.canary.enabled {
        let mut redis = drain.store.redis();
        drain.routes = watch::known(&mut redis, &replay.amqp_url, queue).await?;
        drain.returns = watch::Returns::open(src_conn, &drain.routes).await?;
    }
    let end = drain.run(opts, progress, cancel).await;
    if let End::Drained = end {
        // Every message the pass began with was met: the ledger's doubts about them are settled.
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
    let lost = match &end {
        End::Error(e) if e.is_transient() => Some(e.to_string()),
        End::Error(e) if !drain.connected(src_conn) => Some(format!("connection lost: {e}")),
        _ => None,
    };
    let mut status = drain.finish(end).await;
    if let Some(why) = lost {
        // Not a phase: the next pass picks the drain up where this one left it.
        status.phase = Some(Phase::Draining);
        return Ok(Pass::Lost(status, why));
    }
    if status.phase == Some(Phase::Done) {
        if let Ok(json) = serde_json::to_string(&status) {
            if let Err(e) = drain.store.finish(&json).await {
                if e.is_transient() {
                    return Ok(Pass::Lost(status, e.to_string()));
                }
                status.phase = Some(Phase::Failed);
                status.message = Some(format!("could not record the final status: {e}"));
            }
        }
    }
    Ok(Pass::Ended(status))
}

enum CanaryEnd {
    /// Drain, holding back these signatures.
    Drain(std::collections::HashSet<String>),
    /// Do not drain: the status says why.
    Stop,
}

/// Pending → Canary: check the ground, send one canary per signature, watch, decide.
#[allow(clippy::too_many_arguments)]
async fn canary_phase(
    replay: &Replay,
    opts: &Options,
    progress: &Progress,
    cancel: &CancellationToken,
    conn: &Connection,
    state: &store::State,
    publisher: &mut publish::Publisher,
    store: &mut Store,
    status: &mut DlqReplayStatus,
) -> Result<CanaryEnd, Error> {
    let spec = &replay.spec;
    if let Some(json) = &state.canary {
        // A resumed replay keeps the decisions its canaries already made.
        status.canary = serde_json::from_str(json)
            .map_err(|e| Error::Redis(format!("stored canary results: {e}")))?;
        return Ok(CanaryEnd::Drain(held_of(&status.canary)));
    }
    if !spec.canary.enabled {
        return Ok(CanaryEnd::Drain(Default::default()));
    }
    let claim_value = format!("{}/{}", state.replay_id, state.attempt);
    let mut redis = store.redis();
    let ground = canary::Ground {
        conn,
        amqp_url: &replay.amqp_url,
        redis: redis.clone(),
    };
    let started = tokio::time::Instant::now();
    let mut watch = loop {
        let sel = canary::send(
            &ground,
            spec,
            &state.replay_id,
            &claim_value,
            publisher,
            store,
            &mut redis,
        )
        .await?;
        match sel {
            canary::Selection::Sent(w) => break w,
            canary::Selection::Nothing => return Ok(CanaryEnd::Drain(Default::default())),
            canary::Selection::Refused(why) => {
                status.phase = Some(Phase::Failed);
                status.message = Some(why);
                return Ok(CanaryEnd::Stop);
            }
            canary::Selection::Pending(why, queues) => {
                // The queue is as it was; only the cheap checks run until they pass, then the
                // queue is looked at again.
                let mut why = why;
                loop {
                    status.phase = Some(Phase::Pending);
                    status.message = Some(format!(
                        "{why}; checking again every {}s",
                        opts.recheck.as_secs()
                    ));
                    progress.send_replace(status.clone());
                    let timed_out = opts.pending_timeout.is_some_and(|t| started.elapsed() >= t);
                    if timed_out || cancel.is_cancelled() {
                        status.message = Some(format!(
                            "still Pending ({why}); gave up waiting, nothing was touched"
                        ));
                        return Ok(CanaryEnd::Stop);
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(opts.recheck) => {}
                        _ = cancel.cancelled() => {}
                    }
                    match canary::preflight(conn, spec, &queues).await? {
                        Some(still) => why = still,
                        None => break,
                    }
                }
            }
        }
    };
    add(&mut status.counts, &watch.delta);
    if let Some(a) = status.audit.as_mut() {
        a.records = watch.records;
    }
    status.phase = Some(Phase::Canary);
    // HH:MM:SS is what a person watching the progress bar compares with a clock.
    let until = watch
        .canaries
        .first()
        .and_then(|c| c.wait_until.as_deref())
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.format("%H:%M:%S UTC").to_string())
        .unwrap_or_default();
    status.message = Some(format!(
        "{} canaries out, waiting until {until}",
        watch.canaries.len()
    ));
    status.canary = watch.canaries.clone();
    progress.send_replace(status.clone());
    while !watch
        .look(
            &ground,
            publisher.connection(),
            spec,
            &state.replay_id,
            &mut redis,
        )
        .await?
    {
        status.canary = watch.canaries.clone();
        progress.send_replace(status.clone());
        // The wait lasts up to canary.waitSeconds (30 min at most): a suspend, delete or
        // shutdown must not wait it out. The canaries are out (published, acked, audited) but
        // their verdict is not stored, so a resumed run starts the canary phase again.
        tokio::select! {
            _ = tokio::time::sleep(opts.look) => {}
            _ = cancel.cancelled() => {
                status.phase = Some(Phase::Suspended);
                status.message = Some(format!(
                    "stopped during the canary wait ({} canaries out: published, acked and audited; their verdict is not recorded); running it again starts the canary phase again, one new canary per signature",
                    watch.canaries.len()
                ));
                return Ok(CanaryEnd::Stop);
            }
        }
    }
    status.canary = watch.canaries.clone();
    let json = serde_json::to_string(&status.canary).map_err(|e| Error::Redis(e.to_string()))?;
    store.save_canary(&json).await?;
    let held = watch.held_back();
    if held.len() == watch.canaries.len() {
        let why: Vec<String> = watch
            .canaries
            .iter()
            .map(|c| format!("{}: {}", c.signature, c.reason.clone().unwrap_or_default()))
            .collect();
        status.phase = Some(Phase::CanaryFailed);
        status.message = Some(format!(
            "every canary came back ({}); the rest stays in the queue",
            why.join("; ")
        ));
        return Ok(CanaryEnd::Stop);
    }
    Ok(CanaryEnd::Drain(held))
}

fn held_of(canaries: &[crate::api::CanaryStatus]) -> std::collections::HashSet<String> {
    use crate::api::CanaryResult::{DiedAgain, Unconfirmed};
    canaries
        .iter()
        .filter(|c| matches!(c.result, DiedAgain | Unconfirmed))
        .map(|c| c.signature.clone())
        .collect()
}

async fn declare_quarantine(conn: &Connection, queue: &str) -> Result<(), Error> {
    if source::queue_state(conn, queue).await?.is_some() {
        return Ok(());
    }
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

fn initial_status(state: &store::State, audit_key: String) -> DlqReplayStatus {
    DlqReplayStatus {
        phase: Some(Phase::Pending),
        replay_id: Some(state.replay_id.clone()),
        source_depth_at_start: Some(state.depth_at_start),
        counts: state.counts,
        audit: Some(AuditRef {
            key: audit_key,
            records: state.records,
        }),
        started_at: Some(state.started_at.clone()),
        ..Default::default()
    }
}

/// With a rate limit, a batch holds about a tenth of a second of messages: claims are taken per
/// batch, so this bounds what a crash can leave unknown, and the status follows the rate.
fn batch_size(spec: &DlqReplaySpec, max: usize) -> usize {
    match &spec.rate {
        Some(r) => ((r.messages_per_second / 10) as usize).clamp(1, max.max(1)),
        None => max.max(1),
    }
}

fn limiter(spec: &DlqReplaySpec) -> Option<DefaultDirectRateLimiter> {
    let rate = spec.rate.as_ref()?;
    let per_second = NonZeroU32::new(rate.messages_per_second)?;
    // Default burst: a twentieth of a second's worth, so no second sees much more than the rate.
    let burst = rate.burst.unwrap_or((rate.messages_per_second / 20).max(1));
    let burst = NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN);
    Some(RateLimiter::direct(
        Quota::per_second(per_second).allow_burst(burst),
    ))
}

/// What happens to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Act {
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
    /// Not published because the replay was stopped while the batch waited for the rate
    /// limiter: nothing recorded, its claim released, left unacked (back in the queue when the
    /// pass closes its channel), decided by the next run.
    Unsent,
}

struct Item {
    delivery: Delivery,
    /// The move ledger's digest, computed when needed (a kept or a leftover message).
    digest: Option<String>,
    /// Whether a kept message's copy is at the tail.
    moved: Option<keep::Moved>,
    /// What audit rows call the message (message id or body hash).
    identity: String,
    /// What the settled marks call it: a hash of message id and body.
    fingerprint: String,
    key: Option<String>,
    act: Act,
}

enum End {
    Drained,
    TooManyReturns(u64, String),
    Cancelled,
    Error(Error),
}

struct Drain<'a> {
    replay: &'a Replay,
    replay_id: String,
    claim_value: String,
    source: Option<Source>,
    publisher: publish::Publisher,
    store: Store,
    limiter: Option<DefaultDirectRateLimiter>,
    status: DlqReplayStatus,
    bound: u64,
    seen: u64,
    selected: u64,
    batch: usize,
    /// Signatures whose canary did not pass: their messages stay in the queue.
    held_back: std::collections::HashSet<String>,
    /// Messages of this replay that came back (by fingerprint) behind the pass's bound.
    returns_behind: std::collections::HashSet<String>,
    last_return_check: Option<tokio::time::Instant>,
    /// Moves kept messages to the tail, and the ledger of copies a crash may have doubled.
    keeper: Option<(keep::Mover, keep::Ledger)>,
    /// The dead-letter routes seen (and known before), for the return watch.
    routes: std::collections::BTreeSet<watch::Route>,
    /// The return watch, when a route is known.
    returns: Option<watch::Returns>,
    /// Digests of the messages this pass moved, but for the latest batch's: their ledger counts
    /// come back when the pass has taken its last message (see `finish`).
    moved: Vec<String>,
    /// The latest batch's, whose acks nothing after them waits for.
    last_moved: Vec<String>,
    /// The replay's stop, for the waits inside a batch (the rate limiter).
    cancel: CancellationToken,
}

impl<'a> Drain<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        replay: &'a Replay,
        state: &store::State,
        source: Source,
        publisher: publish::Publisher,
        store: Store,
        status: DlqReplayStatus,
        bound: u64,
        batch: usize,
    ) -> Self {
        Self {
            replay,
            replay_id: state.replay_id.clone(),
            claim_value: format!("{}/{}", state.replay_id, state.attempt),
            source: Some(source),
            publisher,
            store,
            limiter: limiter(&replay.spec),
            // A resumed replay's earlier selections count against the limit.
            selected: state.counts.scanned - state.counts.skipped,
            status,
            bound,
            seen: 0,
            batch,
            held_back: Default::default(),
            returns_behind: Default::default(),
            last_return_check: None,
            keeper: None,
            routes: Default::default(),
            returns: None,
            moved: Vec::new(),
            last_moved: Vec::new(),
            cancel: CancellationToken::new(),
        }
    }

    async fn run(
        &mut self,
        opts: &Options,
        progress: &Progress,
        cancel: &CancellationToken,
    ) -> End {
        let mut stalled = Duration::ZERO;
        loop {
            if self.seen >= self.bound {
                return End::Drained;
            }
            if cancel.is_cancelled() {
                return End::Cancelled;
            }
            let want = self.batch.min((self.bound - self.seen) as usize);
            let Some(src) = self.source.as_mut() else {
                return End::Drained;
            };
            let deliveries = match src.next_batch(want, opts.idle).await {
                Ok(d) => d,
                Err(e) => return End::Error(e),
            };
            if deliveries.is_empty() {
                match self.queue_is_empty().await {
                    Ok(true) => return End::Drained,
                    Ok(false) if stalled >= opts.stall => {
                        return End::Error(Error::Broker(format!(
                            "the dead-letter queue holds messages but delivered none for {}s (another consumer, or a consumer timeout?)",
                            opts.stall.as_secs()
                        )))
                    }
                    Ok(false) => stalled += opts.idle,
                    Err(e) => return End::Error(e),
                }
                continue;
            }
            stalled = Duration::ZERO;
            if let Err(e) = self.step(deliveries).await {
                return End::Error(e);
            }
            match self.check_returns(opts).await {
                Ok(Some(end)) => return end,
                Ok(None) => {}
                Err(e) => return End::Error(e),
            }
            self.report(progress);
        }
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
    fn connected(&self, src_conn: &Connection) -> bool {
        src_conn.status().connected() && self.publisher.connection().status().connected()
    }

    fn is_held_back(&self, props: &lapin::BasicProperties) -> bool {
        !self.held_back.is_empty()
            && self.held_back.contains(&classify::signature(
                &self.replay.spec.canary.signature_header,
                props,
            ))
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

    /// Decide, settle and acknowledge one batch.
    async fn step(&mut self, deliveries: Vec<Delivery>) -> Result<(), Error> {
        let mut items = self.classify(deliveries);
        self.gate(&mut items).await?;
        self.publish(&mut items).await?;
        self.keep(&mut items).await?;
        self.settle(items).await
    }

    /// Leave what the batch does not take (skipped, held back, failed) in the queue: moved to
    /// the tail, behind the pass's bound (see [`keep`]).
    async fn keep(&mut self, items: &mut [Item]) -> Result<(), Error> {
        // A batch with an unconfirmed publish ends the pass: its messages go back to the queue
        // when the channel closes, and the next pass decides them again.
        if items.iter().any(|it| matches!(it.act, Act::Unknown(_))) {
            return Ok(());
        }
        let Some((mover, ledger)) = self.keeper.as_mut() else {
            return Ok(());
        };
        let idx: Vec<usize> = (0..items.len())
            .filter(|&i| matches!(items[i].act, Act::Skip { .. } | Act::Failed(_)))
            .collect();
        if idx.is_empty() {
            return Ok(());
        }
        let digests: Vec<String> = idx
            .iter()
            .map(|&i| {
                let it = &mut items[i];
                it.digest
                    .get_or_insert_with(|| keep::digest(&it.delivery.properties, &it.delivery.data))
                    .clone()
            })
            .collect();
        ledger.intend(&digests).await?;
        let msgs: Vec<_> = idx
            .iter()
            .map(|&i| {
                (
                    &items[i].delivery.properties,
                    items[i].delivery.data.as_slice(),
                )
            })
            .collect();
        let moved = mover.copy(&msgs).await?;
        for (&i, m) in idx.iter().zip(moved) {
            items[i].moved = Some(m);
        }
        Ok(())
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
                    moved: None,
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
                Verdict::Replay { .. } if self.is_held_back(props) => (
                    Act::Skip {
                        reason: "held back: the canary of its signature did not pass".into(),
                        returned: false,
                    },
                    None,
                ),
                Verdict::Replay { key, destination } => (Act::Replay(destination), key),
            };
            if !matches!(act, Act::Skip { .. }) {
                self.selected += 1;
            }
            items.push(Item {
                delivery,
                identity,
                fingerprint,
                digest,
                moved: None,
                key,
                act,
            });
        }
        items
    }

    /// The idempotency gate and the resume check, in one Redis round trip for the batch.
    async fn gate(&mut self, items: &mut [Item]) -> Result<(), Error> {
        let asks: Vec<usize> = (0..items.len())
            .filter(|&i| matches!(items[i].act, Act::Replay(_) | Act::Quarantine(_)))
            .collect();
        if asks.is_empty() {
            return Ok(());
        }
        let key_fields: Vec<Option<String>> = asks
            .iter()
            .map(|&i| items[i].key.as_ref().map(|k| format!("key:{k}")))
            .collect();
        let fields: Vec<(&str, Option<&str>)> = asks
            .iter()
            .zip(&key_fields)
            .map(|(&i, k)| (items[i].fingerprint.as_str(), k.as_deref()))
            .collect();
        let keys: Vec<Option<&str>> = asks
            .iter()
            .map(|&i| match items[i].act {
                Act::Replay(_) => items[i].key.as_deref(),
                _ => None,
            })
            .collect();
        let idem = self.replay.spec.idempotency.as_ref();
        let claim = idem
            .filter(|i| i.mode == IdempotencyMode::Claim)
            .map(|i| (self.claim_value.as_str(), i.ttl_seconds));
        let lookups = self.store.lookup(&fields, &keys, claim).await?;
        let done = idem.map(|i| i.done_value.as_str()).unwrap_or("");
        let prefix = format!("{}/", self.replay_id);
        for (&i, l) in asks.iter().zip(lookups) {
            let item = &mut items[i];
            if item.delivery.redelivered && l.settled.is_some() {
                // Settled by an earlier run whose ack was lost: its audit row exists already.
                item.act = Act::AlreadySettled;
                continue;
            }
            if !matches!(item.act, Act::Replay(_)) || item.key.is_none() {
                continue;
            }
            item.act = match (claim, l.value.as_deref()) {
                (_, Some(v)) if v == done => Act::Duplicate { reason: "key is done".into(), same_attempt: false },
                (None, _) => continue,
                (Some(_), _) if l.claimed => continue,
                (Some((mine, _)), Some(v)) if v == mine => Act::Duplicate {
                    reason: "key already replayed by this replay".into(),
                    same_attempt: true,
                },
                (Some(_), Some(v)) if v.starts_with(&prefix) => match l.key_replayed {
                    Some(_) => Act::Duplicate { reason: "key already replayed by this replay".into(), same_attempt: false },
                    // Claimed by an earlier run of this replay that crashed before recording
                    // the outcome: it may or may not have been published. Never twice.
                    None => Act::Quarantine(
                        "OutcomeUnknown: claimed by an earlier run of this replay that stopped before recording the publish".into(),
                    ),
                },
                (Some(_), Some(v)) => match store::Held::of(Some(v), done) {
                    // Another replay claimed it and never recorded a confirmed publish: its work
                    // may never have gone out, so it is not dropped as a duplicate.
                    held @ store::Held::Unconfirmed(_) => Act::Quarantine(format!(
                        "OutcomeUnknown: claimed by replay {} without a confirmed publish",
                        held.replay().unwrap_or_default()
                    )),
                    _ => Act::Duplicate { reason: format!("key is claimed ({v})"), same_attempt: false },
                },
                // The claim was refused but the key vanished in between (expired): leave it.
                (Some(_), None) => Act::Failed("claim refused, then the key vanished; left in the queue".into()),
            };
        }
        Ok(())
    }

    /// Publish quarantines and replays, then wait for every confirm of the batch.
    async fn publish(&mut self, items: &mut [Item]) -> Result<(), Error> {
        self.publisher.ensure_open().await?;
        let quarantine = Destination {
            exchange: String::new(),
            routing_key: self.replay.spec.quarantine.queue.clone(),
        };
        let user = self.publisher.user().to_string();
        let mut pending = Vec::new();
        for (i, item) in items.iter_mut().enumerate() {
            let props = &item.delivery.properties;
            let (dest, props) = match &item.act {
                Act::Quarantine(reason) => (
                    quarantine.clone(),
                    publish::quarantine_properties(props, &self.replay_id, reason, &user),
                ),
                Act::Replay(dest) => {
                    if !self.publisher.exchange_exists(&dest.exchange).await? {
                        item.act = Act::Failed(format!(
                            "NoExchange: exchange {:?} does not exist",
                            dest.exchange
                        ));
                        continue;
                    }
                    if let Some(l) = &self.limiter {
                        // At a low rate a batch waits seconds for its tokens: a stop ends the
                        // wait, and what the batch has not sent yet stays for the next run.
                        let stopped = tokio::select! {
                            biased;
                            _ = self.cancel.cancelled() => true,
                            _ = l.until_ready() => false,
                        };
                        if stopped {
                            item.act = Act::Unsent;
                            continue;
                        }
                    }
                    let p = publish::replay_properties(
                        props,
                        &self.replay_id,
                        item.key.as_deref(),
                        &user,
                    );
                    (dest.clone(), p)
                }
                _ => continue,
            };
            match self.publisher.send(&dest, props, &item.delivery.data).await {
                Ok(confirm) => pending.push((i, confirm)),
                // Refused before it left (e.g. the channel is closed): it was not sent.
                Err(e) => item.act = Act::Failed(format!("NotSent: {e}")),
            }
        }
        let (idx, confirms): (Vec<usize>, Vec<_>) = pending.into_iter().unzip();
        let metrics = crate::metrics::Metrics::global();
        let sent = std::time::Instant::now();
        let timed = confirms.into_iter().map(|c| {
            let latency = &metrics.publish_latency;
            async move {
                let res = c.await;
                latency.observe(sent.elapsed().as_secs_f64());
                res
            }
        });
        let results = futures::future::join_all(timed).await;
        // A confirm that never came (the channel or the connection closed first) leaves the
        // outcome unknown, even when the broker closed the channel because of a later publish
        // (e.g. to an exchange deleted mid-drain): an earlier one may have been routed and
        // persisted with its confirm still on the way.
        for (i, res) in idx.into_iter().zip(results) {
            let item = &mut items[i];
            let unconfirmed = res.is_err();
            item.act = match (publish::outcome(res), &item.act) {
                (Ok(()), Act::Replay(d)) => Act::Replayed(d.clone()),
                (Ok(()), Act::Quarantine(r)) => Act::Quarantined(r.clone()),
                (Err(why), _) if unconfirmed => Act::Unknown(why),
                (Err(why), _) => Act::Failed(why),
                (Ok(()), other) => other.clone(),
            };
        }
        // A publish to a deleted exchange closes the channel: what the batch had not sent yet
        // was refused for the same reason, and says so.
        let closed_on = items.iter().find_map(|it| match &it.act {
            Act::Unknown(r) if r.starts_with("NoExchange") => Some(r.clone()),
            _ => None,
        });
        if let Some(cause) = closed_on {
            for it in items.iter_mut() {
                if matches!(&it.act, Act::Failed(r) if r.starts_with("NotSent")) {
                    it.act = Act::Failed(format!("{cause}; not sent after it"));
                }
            }
        }
        // A message whose key was claimed earlier in this batch by one that failed is not a
        // duplicate after all: its work never went out (or may not have). It stays in the queue.
        let failed: std::collections::HashSet<&str> = items
            .iter()
            .filter(|it| matches!(it.act, Act::Failed(_) | Act::Unknown(_) | Act::Unsent))
            .filter_map(|it| it.key.as_deref())
            .collect();
        // (Its twin of a message left unsent stays unsent too: the next run decides both.)
        let unsent: std::collections::HashSet<String> = items
            .iter()
            .filter(|it| matches!(it.act, Act::Unsent))
            .filter_map(|it| it.key.clone())
            .collect();
        let orphans: Vec<usize> = (0..items.len())
            .filter(|&i| {
                matches!(
                    items[i].act,
                    Act::Duplicate {
                        same_attempt: true,
                        ..
                    }
                ) && items[i].key.as_deref().is_some_and(|k| failed.contains(k))
            })
            .collect();
        for i in orphans {
            items[i].act = if items[i].key.as_ref().is_some_and(|k| unsent.contains(k)) {
                Act::Unsent
            } else {
                Act::Failed("same key as a message of this batch whose publish failed".into())
            };
        }
        Ok(())
    }

    /// Record the batch (audit rows, settled marks, counts) atomically, then ack what is settled
    /// or moved, and once the broker has processed those acks, take the moves' ledger counts
    /// back.
    async fn settle(&mut self, items: Vec<Item>) -> Result<(), Error> {
        let mut rows = Vec::new();
        let mut settled = Vec::new();
        let mut claims = Vec::new();
        let mut delta = Counts::default();
        let mut acks = Vec::new();
        let mut refused = Vec::new();
        let mut moved_digests = Vec::new();
        let mut unknown = 0u32;
        let mut unknown_why = String::new();
        // Unconfirmed publishes end the pass after this batch.
        let ending = items.iter().any(|it| matches!(it.act, Act::Unknown(_)));
        let time = now();
        let claiming = self
            .replay
            .spec
            .idempotency
            .as_ref()
            .is_some_and(|i| i.mode == IdempotencyMode::Claim);
        for item in &items {
            // A kept message is acked once its copy is at the tail; a refused copy means no
            // copy exists, so its ledger count comes back (the original stays unacked).
            let moved = match item.moved {
                Some(keep::Moved::Copied) => {
                    acks.push(item.delivery.delivery_tag);
                    moved_digests.extend(item.digest.clone());
                    true
                }
                Some(keep::Moved::Refused) => {
                    refused.extend(item.digest.clone());
                    false
                }
                _ => false,
            };
            let (decision, reason, destination) = match &item.act {
                Act::AlreadySettled => {
                    acks.push(item.delivery.delivery_tag);
                    continue;
                }
                Act::Skip { returned, .. } => {
                    delta.scanned += 1;
                    delta.skipped += 1;
                    delta.returned += u64::from(*returned);
                    continue;
                }
                Act::Leftover => {
                    delta.duplicates += 1;
                    (
                        "duplicate",
                        "LeftoverCopy: a second copy of a message this pass already met, left by an interrupted move".to_string(),
                        String::new(),
                    )
                }
                Act::Replayed(d) => {
                    delta.replayed += 1;
                    if claiming {
                        if let Some(k) = &item.key {
                            claims.push(self.claim_end(k, true));
                        }
                    }
                    (
                        "replayed",
                        String::new(),
                        format!("{}/{}", d.exchange, d.routing_key),
                    )
                }
                Act::Quarantined(r) => {
                    delta.quarantined += 1;
                    (
                        "quarantined",
                        r.clone(),
                        self.replay.spec.quarantine.queue.clone(),
                    )
                }
                Act::Duplicate { reason, .. } => {
                    delta.duplicates += 1;
                    ("duplicate", reason.clone(), String::new())
                }
                Act::Failed(r) => {
                    if claiming {
                        if let Some(k) = &item.key {
                            claims.push(self.claim_end(k, false));
                        }
                    }
                    if ending {
                        // It stays in the queue for the next pass, which decides (and counts)
                        // it again: recording it here too would count it twice.
                        continue;
                    }
                    delta.failed += 1;
                    ("failed", r.clone(), String::new())
                }
                Act::Unknown(why) => {
                    unknown += 1;
                    unknown_why.clone_from(why);
                    continue;
                }
                Act::Unsent => {
                    if claiming {
                        if let Some(k) = &item.key {
                            claims.push(self.claim_end(k, false));
                        }
                    }
                    continue;
                }
                // Publish resolves every Replay and Quarantine.
                Act::Replay(_) | Act::Quarantine(_) => continue,
            };
            delta.scanned += 1;
            if decision != "failed" {
                if !matches!(item.act, Act::Leftover) {
                    settled.push((item.fingerprint.clone(), decision.to_string()));
                }
                if decision == "replayed" {
                    if let Some(k) = &item.key {
                        settled.push((format!("key:{k}"), item.identity.clone()));
                    }
                }
                if !moved {
                    acks.push(item.delivery.delivery_tag);
                }
            }
            rows.push(AuditRow {
                id: String::new(),
                replay: self.replay_id.clone(),
                message: item.identity.clone(),
                decision: decision.into(),
                key: item.key.clone().unwrap_or_default(),
                reason,
                destination,
                canary: false,
                time: time.clone(),
            });
        }
        let (records, again) = self.store.commit(&rows, &settled, &claims, &delta).await?;
        if claiming && again > 0 {
            // The invariant Claim mode exists for broke: say so loudly, and count it.
            tracing::error!(replay = %self.replay_id, keys = again, "Claim mode published a key twice");
            crate::metrics::Metrics::global()
                .double_published
                .inc_by(again);
        }
        add(&mut self.status.counts, &delta);
        if let Some(a) = self.status.audit.as_mut() {
            a.records = records;
        }
        let src = self
            .source
            .as_mut()
            .ok_or_else(|| Error::Broker("source closed".into()))?;
        acks.sort_unstable();
        src.ack(&acks, acks.len() == items.len(), items.len())
            .await?;
        // The moves' ledger counts come back once the queue has applied the acks (see
        // source::get_one): the pass takes its last message with basic.get after every other
        // ack, which makes sure of that for every batch but the last; those are taken back when
        // the pass closes, the last batch's stay for the next traversal to settle.
        let earlier = std::mem::replace(&mut self.last_moved, moved_digests);
        self.moved.extend(earlier);
        if !refused.is_empty() {
            if let Some((_, ledger)) = self.keeper.as_mut() {
                ledger.take_back(&refused).await?;
            }
        }
        if unknown > 0 {
            // What was confirmed is recorded and acked; the unconfirmed wait for the next pass,
            // which finds their claims (or publishes them again in Check mode) like a rerun.
            let closed = if self.publisher.connection().status().connected() {
                "the publishing channel closed"
            } else {
                "connection lost"
            };
            return Err(Error::Connection(format!(
                "{closed} with {unknown} publishes unconfirmed ({unknown_why})"
            )));
        }
        Ok(())
    }

    /// Take back the ledger counts of the messages moved before the pass's last batch (a pass
    /// that ended early leaves them for the next traversal to settle).
    async fn take_back_moved(&mut self) {
        let Some((_, ledger)) = self.keeper.as_mut() else {
            return;
        };
        for chunk in std::mem::take(&mut self.moved).chunks(4096) {
            if let Err(e) = ledger.take_back(chunk).await {
                tracing::warn!(error = %e, "taking back the move ledger's counts");
                return;
            }
        }
    }

    /// The end of this attempt's claim on `key`: published, or released.
    fn claim_end(&self, key: &str, published: bool) -> store::ClaimEnd {
        store::ClaimEnd {
            key: key.to_string(),
            value: self.claim_value.clone(),
            published,
        }
    }

    fn report(&mut self, progress: &Progress) {
        let left = self.bound.saturating_sub(self.seen);
        self.status.message = Some(format!("replaying, {left} left of this pass"));
        progress.send_replace(self.status.clone());
    }

    /// Close the pass: everything still unacked goes back to the queue in place.
    async fn finish(&mut self, end: End) -> DlqReplayStatus {
        if let Some(src) = self.source.take() {
            let took_all = src.took_all();
            if let Err(e) = src.close().await {
                tracing::warn!(error = %e, "closing the dead-letter queue channel");
            } else if took_all {
                self.take_back_moved().await;
            }
        }
        let mut status = self.status.clone();
        let summary = summary(&status.counts);
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

/// The counts as a status message says them.
pub fn summary(c: &Counts) -> String {
    format!(
        "replayed {}, duplicates {}, quarantined {}, skipped {}, failed {}",
        c.replayed, c.duplicates, c.quarantined, c.skipped, c.failed
    )
}

fn add(c: &mut Counts, d: &Counts) {
    c.scanned += d.scanned;
    c.replayed += d.replayed;
    c.duplicates += d.duplicates;
    c.quarantined += d.quarantined;
    c.skipped += d.skipped;
    c.failed += d.failed;
    c.returned += d.returned;
}
