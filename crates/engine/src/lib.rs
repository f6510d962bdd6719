//! The replay engine: one decision per message, nothing acked before its outcome is durable.
//!
//! No Kubernetes in here, and no dependency that brings it (`.ci/engine-deps` checks): the CLI
//! and the operator both hand the engine a [`Replay`] (a [`spec::DlqReplaySpec`] plus resolved
//! URLs) and watch its [`Progress`] (a [`status::ReplayStatus`]). The operator's metrics hear of
//! the engine's retries and confirms through [`observe::Observer`].
//!
//! A replay flows one way through the stages below: [`run`] opens its context once, then
//! pre-flight, canary, drain and finish run in order over it.

pub mod amqp;
pub mod endpoints;
mod error;
pub mod observe;
pub mod redact;
pub mod spec;
pub mod status;
pub mod tls;

pub mod canary;
pub mod classify;
mod drain;
pub mod keep;
pub mod key;
pub mod message;
mod pass;
pub mod plan;
mod preflight;
pub mod publish;
pub mod scan;
pub mod source;
pub mod store;
pub mod watch;

use std::time::Duration;

use amqp::Connection;
use tokio_util::sync::CancellationToken;

use crate::spec::DlqReplaySpec;
use crate::status::{Counts, Phase, ReplayStatus};
pub use error::{redis_connection_lost, Error};
use pass::{Opened, Pass, PassEnd};
pub use preflight::{redis_check, RedisCheck};

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

/// The AMQP user of a URL (what `user-id` must equal), `guest` when absent. Every endpoint of a
/// clustered broker's URL logs in as the same user: the first one's is read.
pub fn amqp_user(url: &str) -> String {
    url::Url::parse(&endpoints::first(url))
        .ok()
        .map(|u| u.username().to_string())
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "guest".into())
}

/// How long one endpoint may take to accept a connection before the next one is tried: a node
/// that is gone without a reset (a partition, a stopped VM) must not hold the replay for the
/// kernel's TCP timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connect to the broker with a connection name that says who we are (so an operator can find,
/// or close, our connections in `rabbitmqctl list_connections`).
///
/// A clustered broker's URL names several endpoints ([`endpoints`]): they are tried in order and
/// the first that accepts is used, so a replay whose node was lost goes on through another node
/// at its next pass. A refused login is not worth another endpoint (they share users) and ends
/// the attempt at once.
pub async fn connect_amqp(url: &str, name: &str) -> Result<Connection, Error> {
    crate::tls::install_provider();
    let all = endpoints::split(url).map_err(|e| Error::Config(format!("broker URL: {e}")))?;
    let mut lost = Vec::new();
    for (i, endpoint) in all.iter().enumerate() {
        match connect_one(endpoint, name).await {
            Ok(conn) => {
                if i > 0 {
                    tracing::info!(endpoint = i + 1, of = all.len(), unreachable = %lost.join("; "), "connected to the broker through another endpoint");
                }
                return Ok(conn);
            }
            Err(Error::Connection(why)) => lost.push(why),
            Err(e) => return Err(e),
        }
    }
    Err(Error::Connection(lost.join("; ")))
}

async fn connect_one(url: &str, name: &str) -> Result<Connection, Error> {
    let host = url::Url::parse(url)
        .map(|u| {
            format!(
                "{}:{}",
                u.host_str().unwrap_or(""),
                u.port_or_known_default().unwrap_or(5672)
            )
        })
        .unwrap_or_default();
    let connecting = Connection::connect(url, name);
    let Ok(connected) = tokio::time::timeout(CONNECT_TIMEOUT, connecting).await else {
        return Err(Error::Connection(format!(
            "broker: cannot connect to {host}: no answer within {}s",
            CONNECT_TIMEOUT.as_secs()
        )));
    };
    connected.map_err(|e| {
        let why = crate::tls::hint(format!(
            "cannot connect to {host}: {}",
            crate::redact::error(&e.to_string(), url)
        ));
        // Refused or reset (a broker restarting) is worth another try; a refused login is not.
        if e.is_connection_lost() {
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
    let mut first = true;
    loop {
        let after = !std::mem::replace(&mut first, false);
        let why = match run_pass(replay, opts, progress, cancel, after).await {
            // `Pass::run` turns a Pending end into Again or Ended (`pass::pending_wait`).
            Ok(PassEnd::Ended(status) | PassEnd::Pending(status, _)) => return Ok(status),
            Ok(PassEnd::Again(status)) => {
                // A Pending pass whose checks pass now: the next pass starts at once.
                lost_since = None;
                delays = reconnect_delays();
                last = status;
                continue;
            }
            Ok(PassEnd::Lost(status, why)) => {
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

/// One pass on fresh connections ([`pass`]): its context opened once, then its stages; `after`:
/// it follows a pass of this run.
async fn run_pass(
    replay: &Replay,
    opts: &Options,
    progress: &Progress,
    cancel: &CancellationToken,
    after: bool,
) -> Result<PassEnd, Error> {
    let end = match Pass::open(replay, opts, progress, cancel, after).await? {
        Opened::Ended(status) => PassEnd::Ended(status),
        Opened::Lost(status, why) => PassEnd::Lost(status, why),
        Opened::Ready(pass) => match pass.run().await {
            Ok(end) => end,
            // The replay has begun: a lost connection from here on is worth another pass.
            Err(e) if e.is_transient() => PassEnd::Lost(progress.borrow().clone(), e.to_string()),
            Err(e) => return Err(e),
        },
    };
    if let PassEnd::Ended(status) = &end {
        progress.send_replace(status.clone());
    }
    Ok(end)
}

fn gave_up(mut status: ReplayStatus, why: &str, budget: Duration) -> ReplayStatus {
    status.phase = Some(Phase::Failed);
    status.message = Some(format!(
        "{why}; gave up reconnecting after {}s; unsettled messages are still in the dead-letter queue; run it again to resume",
        budget.as_secs()
    ));
    status
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
