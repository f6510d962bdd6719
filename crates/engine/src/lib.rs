//! The replay engine: one decision per message, nothing acked before its outcome is durable.
//!
//! No Kubernetes in here, and no dependency that brings it (`.ci/engine-deps` checks): the CLI
//! and the operator both hand the engine a [`Replay`] (a [`spec::DlqReplaySpec`] plus resolved
//! URLs) and watch its [`Progress`] (a [`status::ReplayStatus`]). The operator's metrics hear of
//! the engine's retries and confirms through [`observe::Observer`].
//!
//! A replay flows one way through the stages below: [`run`] opens its context once, then
//! pre-flight, canary, drain and finish run in order over it.

mod error;
pub mod observe;
pub mod redact;
pub mod spec;
pub mod status;
pub mod tls;

pub mod canary;
mod canary_phase;
pub mod classify;
mod drain;
pub mod keep;
pub mod key;
pub mod message;
pub mod plan;
mod preflight;
pub mod proven;
pub mod publish;
pub mod scan;
pub mod source;
pub mod store;
pub mod watch;

use std::num::NonZeroU32;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use crate::spec::DlqReplaySpec;
use crate::status::{AuditRef, Counts, Phase, ReplayStatus};
use canary_phase::{canary_phase, CanaryEnd};
use drain::{Drain, End};
pub use error::{broker_connection_lost, redis_connection_lost, Error};
use preflight::{audit_config, redis_preflight};
pub use preflight::{redis_check, RedisCheck};
use source::Source;
use store::Store;

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
    /// The in-flight window: messages claimed or published and not yet recorded, at most. It is
    /// the most a crash can leave unknown (Claim mode: quarantined `OutcomeUnknown` by the next
    /// run; Check mode: published again). The drain works in steps of half of it, so the broker
    /// has publishes to confirm while the previous step is recorded.
    pub window: usize,
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
            window: DEFAULT_WINDOW,
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

/// The default in-flight window ([`Options::window`]): a kill -9 leaves at most 32 messages
/// unknown. A larger window drains faster where the broker's confirms are slow (the drain's
/// speed is about window / confirm latency; see bench/RESULTS.md).
pub const DEFAULT_WINDOW: usize = 32;

/// Where the engine publishes its status as it goes.
pub type Progress = tokio::sync::watch::Sender<ReplayStatus>;

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
) -> Result<ReplayStatus, Error> {
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
        crate::observe::observer().retried("reconnect");
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

/// 0.25 s doubling up to `max`, with jitter, without end (the engine's reconnects, the
/// operator's status writes).
pub fn backoff(max: Duration) -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}

fn gave_up(mut status: ReplayStatus, why: &str, budget: Duration) -> ReplayStatus {
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
    Ended(ReplayStatus),
    /// A connection went away: the status so far, and why.
    Lost(ReplayStatus, String),
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
    // A stop (suspend, delete, shutdown) ends the waits between Redis retries (see Store::stop_on).
    store.stop_on(cancel.clone());
    if let Some(done) = &state.final_status {
        let status: ReplayStatus = serde_json::from_str(done)
            .map_err(|e| Error::Redis(format!("stored final status is unreadable: {e}")))?;
        progress.send_replace(status.clone());
        let _ = src_conn.close(200, "done".into()).await;
        return Ok(Pass::Ended(status));
    }
    let mut status = initial_status(&state, store.keys().audit.clone());
    status.redis_eviction_risk = eviction_risk;
    if let Some(a) = status.audit.as_mut() {
        a.sink = replay.spec.audit_sink();
    }
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
    mut status: ReplayStatus,
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
    let proven = match phase {
        Ok(CanaryEnd::Drain(proven)) => proven,
        Ok(CanaryEnd::Stop) => {
            if status.phase == Some(Phase::CanaryFailed) {
                status.finished_at = Some(now());
                if let Ok(json) = serde_json::to_string(&status) {
                    store.finish(&json, false).await?;
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

    let window = opts.window.max(1);
    let step = step_size(&replay.spec, window);
    let queue = &replay.spec.source.queue;
    let src = Source::open(src_conn, queue, prefetch(window), depth.into()).await?;
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
    drain.proven = proven;
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
            if let Err(e) = drain.store.finish(&json, true).await {
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
/// other's publishes are confirmed; measured faster than four smaller steps at the same window). With a rate limit,
/// at most about a tenth of a second of messages, so the status follows the rate.
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

/// The counts as a status message says them.
pub fn summary(c: &Counts) -> String {
    format!(
        "replayed {}, duplicates {}, quarantined {}, skipped {}, failed {}",
        c.replayed, c.duplicates, c.quarantined, c.skipped, c.failed
    )
}

pub(crate) fn add(c: &mut Counts, d: &Counts) {
    c.add(d);
}
