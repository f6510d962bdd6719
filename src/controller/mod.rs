//! The operator: a kube-runtime `Controller` that drives each `DlqReplay` through its phases by
//! running the shared engine as one task per active replay.
//!
//! Reconcile is dereference → decide → run/resume → write status. It is idempotent: a replay has
//! at most one task (keyed by namespace/name), a finished replay is never started again, and an
//! operator restart resumes an unfinished one from its status and the engine's Redis state.
//!
//! Stopping is cooperative and bounded: a shutdown (SIGTERM/SIGINT, see [`run_until`] and
//! [`run_with_leader_election`]), a lost Lease, a `spec.suspend` or a deletion cancels the
//! replay's task; the engine settles the batch in flight (every wait it may be in watches the
//! cancellation), the final status is written, and on a shutdown the Lease is released last.

pub mod lease;
pub mod status;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{finalizer, Event as Finalizer};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use tokio::sync::{watch, Mutex};
use tokio_util::sync::CancellationToken;

use crate::api::{
    CanaryResult, ConnectionSpec, DlqReplay, DlqReplayStatus, Phase, RETRY_ANNOTATION,
};
use crate::engine::{self, Replay};

/// The finalizer that lets a deleted replay settle its in-flight messages first.
pub const FINALIZER: &str = "replay.dlq.dev/finalizer";

/// Reconcile errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed.
    #[error("kube: {0}")]
    Kube(#[from] kube::Error),
    /// The finalizer helper failed.
    #[error("finalizer: {0}")]
    Finalizer(String),
}

/// How the operator runs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Watch only this namespace (all when `None`).
    pub namespace: Option<String>,
    /// The most replays this operator drives at once.
    pub max_concurrent: usize,
    /// The least time between two status writes of a draining replay.
    pub status_interval: Duration,
    /// Engine knobs.
    pub engine: engine::Options,
    /// This instance's name (pod name), for events.
    pub instance: String,
    /// How long a status write that failed for a passing reason (API server unreachable, 5xx,
    /// 429, conflict) is tried again, with backoff, before it is given up.
    pub status_retry: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            namespace: None,
            max_concurrent: 4,
            status_interval: Duration::from_secs(2),
            engine: engine::Options::default(),
            instance: "dlq-replay".into(),
            status_retry: Duration::from_secs(10),
        }
    }
}

/// The field manager of everything the operator writes with server-side apply.
pub const MANAGER: &str = "dlq-replay";

/// The name of the leader-election Lease.
pub const LEASE: &str = "dlq-replay-leader";

/// The longest the operator waits for one answer of the API server on a replay's behalf (a
/// status write, an event).
const API_CALL_TIMEOUT: Duration = Duration::from_secs(5);

struct Task {
    source: String,
    cancel: CancellationToken,
    /// Set before `cancel` when the stop is the user's `spec.suspend`; any other stop is the
    /// operator's own (shutdown, lost lease, deletion).
    by_user: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<()>,
}

/// What reconcile needs.
pub struct Context {
    client: Client,
    recorder: Recorder,
    settings: Settings,
    tasks: Mutex<HashMap<String, Task>>,
}

impl Context {
    /// A context for a client.
    pub fn new(client: Client, settings: Settings) -> Arc<Self> {
        let reporter = Reporter {
            controller: "dlq-replay".into(),
            instance: Some(settings.instance.clone()),
        };
        Arc::new(Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            settings,
            tasks: Mutex::default(),
        })
    }

    /// Stop every task (their in-flight messages settle first) — for a clean shutdown. All are
    /// told at once and settle side by side.
    pub async fn stop_all(&self) {
        let tasks: Vec<Task> = self.tasks.lock().await.drain().map(|(_, t)| t).collect();
        for t in &tasks {
            t.cancel.cancel();
        }
        futures::future::join_all(tasks.into_iter().map(|t| t.handle)).await;
    }

    /// How many replays run now.
    pub async fn running(&self) -> usize {
        self.tasks.lock().await.len()
    }
}

/// The `/healthz` names of the controller and of the lease loop.
const CONTROLLER_PART: &str = "controller";
const LEASE_PART: &str = "lease";

/// Lead, then drive replays while leading, until `shutdown` is cancelled: only the holder of the
/// [`LEASE`] runs replays, so two replicas never replay the same queue (see [`lease`]).
///
/// - Losing the Lease (another replica holds it, or it could not be renewed within the renew
///   deadline) stops every task after its in-flight messages settle, then follows again.
/// - `shutdown` stops the controller and every task the same way (status `OperatorStopped`),
///   keeps renewing meanwhile, then releases the Lease so that another replica takes over at its
///   next ask (2 s), and returns `Ok`. A follower returns at once.
/// - The controller dying (a panic) stops the tasks, releases the Lease and returns `Err`;
///   `/healthz` says so meanwhile, and so it does when the lease loop stalls.
pub async fn run_with_leader_election(
    client: Client,
    settings: Settings,
    lease_ns: &str,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let cfg = lease::LeaseConfig::new(LEASE, lease_ns, &settings.instance);
    let (retry, stale) = (cfg.retry, cfg.duration * 2);
    let mut elector = lease::Elector::new(client.clone(), cfg);
    loop {
        metrics.leader.set(0);
        loop {
            metrics.alive(LEASE_PART, Some(stale));
            match elector.try_acquire_or_renew().await {
                Ok(true) => break,
                Ok(false) => metrics.set_ready(true),
                Err(e) => tracing::warn!(error = %e, "asking for the lease"),
            }
            tokio::select! {
                _ = tokio::time::sleep(jittered(retry)) => {}
                _ = shutdown.cancelled() => {
                    metrics.stopped(LEASE_PART);
                    tracing::info!("shutdown: not leading, nothing to settle");
                    return Ok(());
                }
            }
        }
        metrics.set_ready(true);
        metrics.leader.set(1);
        tracing::info!(instance = %settings.instance, "leading: driving replays");
        // Cancelled by a shutdown, or by this loop when the Lease is lost.
        let stop = shutdown.child_token();
        let mut controller = tokio::spawn(run_until(
            client.clone(),
            settings.clone(),
            stop.clone().cancelled_owned(),
        ));
        // Renew while the controller runs and while its replays settle after a stop: the Lease
        // stays ours until they did.
        let ended = loop {
            tokio::select! {
                ended = &mut controller => break ended,
                _ = tokio::time::sleep(retry) => {}
            }
            metrics.alive(LEASE_PART, Some(stale));
            if stop.is_cancelled() && !shutdown.is_cancelled() {
                continue; // stepping down: no more renewals
            }
            match elector.try_acquire_or_renew().await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!("another replica holds the lease: stopping the replays");
                    stop.cancel();
                }
                Err(e) if elector.renewal_overdue() => {
                    tracing::warn!(error = %e, "could not renew the lease within the renew deadline: stopping the replays");
                    stop.cancel();
                }
                Err(e) => tracing::warn!(error = %e, "renewing the lease; trying again"),
            }
        };
        metrics.leader.set(0);
        let died = match ended {
            Ok(Ok(())) => None,
            Ok(Err(why)) => Some(why),
            Err(e) => Some(format!("the controller task failed: {e}")),
        };
        if died.is_none() && !shutdown.is_cancelled() {
            tracing::warn!("lost the lease: replays stopped, waiting to lead again");
            continue;
        }
        match elector.release().await {
            Ok(true) => tracing::info!("released the lease"),
            Ok(false) => tracing::info!("the lease was no longer ours"),
            Err(e) => tracing::warn!(error = %e, "releasing the lease; it expires by itself"),
        }
        metrics.stopped(LEASE_PART);
        return match died {
            Some(why) => Err(why),
            None => Ok(()),
        };
    }
}

/// `d` ± 10 %, so that replicas do not ask in step.
fn jittered(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.subsec_nanos());
    d.mul_f64(0.9 + f64::from(nanos % 1000) / 5000.0)
}

/// SIGTERM or SIGINT (Ctrl-C): the name of the one that came.
pub async fn signalled() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            return tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    "SIGINT"
}

/// Run the controller until the process is signalled (SIGTERM or SIGINT); `Err` when the
/// controller died instead.
pub async fn run(client: Client, settings: Settings) -> Result<(), String> {
    run_until(client, settings, async {
        let _ = signalled().await;
    })
    .await
}

/// Run the controller until `stop` completes, then stop every replay task (each settles its
/// in-flight messages and writes its status). `Err` when the controller died instead (a
/// panic): its tasks are stopped the same way, and `/healthz` says so.
pub async fn run_until(
    client: Client,
    settings: Settings,
    stop: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), String> {
    let api: Api<DlqReplay> = match &settings.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let ctx = Context::new(client, settings);
    let metrics = crate::metrics::Metrics::global();
    metrics.alive(CONTROLLER_PART, None);
    let stopping = CancellationToken::new();
    let asked = stopping.clone();
    let controller = Controller::new(api, watcher::Config::default())
        .graceful_shutdown_on(async move {
            stop.await;
            asked.cancel();
        })
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "reconcile");
            }
        });
    // A task of its own: a panic in it still lets the replays stop cleanly.
    let ended = tokio::spawn(controller).await;
    let died = match ended {
        Err(e) => Some(format!("the controller panicked: {e}")),
        Ok(()) if !stopping.is_cancelled() => Some("the controller stream ended".to_string()),
        Ok(()) => None,
    };
    if let Some(why) = &died {
        tracing::error!(error = %why, "the controller died; stopping the replays");
        metrics.died(CONTROLLER_PART, why);
    }
    ctx.stop_all().await;
    // The next leader shows the replays; series left here would be stale.
    metrics.forget_replays();
    match died {
        Some(why) => Err(why),
        None => {
            metrics.stopped(CONTROLLER_PART);
            Ok(())
        }
    }
}

fn key_of(obj: &DlqReplay) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

/// Reconcile one replay.
pub async fn reconcile(obj: Arc<DlqReplay>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = obj.namespace_or_default();
    let api: Api<DlqReplay> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, obj, |event| async {
        match event {
            Finalizer::Apply(o) => apply(o, ctx.clone()).await,
            Finalizer::Cleanup(o) => cleanup(o, ctx.clone()).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(e.to_string()))
}

/// Back off and try again.
pub fn error_policy(_obj: Arc<DlqReplay>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(%error, "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

async fn apply(obj: Arc<DlqReplay>, ctx: Arc<Context>) -> Result<Action, Error> {
    if let Some(action) = refuse_invalid_spec(&ctx, &obj).await? {
        return Ok(action);
    }
    let key = key_of(&obj);
    let phase = obj.status.as_ref().and_then(|s| s.phase);
    let running = ctx.tasks.lock().await.contains_key(&key);
    if running {
        if obj.spec.suspend {
            if let Some(t) = ctx.tasks.lock().await.get(&key) {
                t.by_user.store(true, Ordering::SeqCst);
                t.cancel.cancel();
            }
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    // Not running here: its stored status is current (a running one's is shown by its writes).
    crate::metrics::Metrics::global().observe_replay(
        &obj.namespace_or_default(),
        &obj.name_any(),
        obj.status.as_ref(),
        obj.spec.poison.max_quarantine_ratio,
    );
    if phase.is_some_and(Phase::is_terminal) {
        observe_generation(&ctx, &obj).await?;
        return retry_if_asked(&ctx, &obj).await;
    }
    if obj.spec.suspend {
        let mut msg = "suspended by spec.suspend; set it to false to resume".to_string();
        if let Some(note) = obj.status.as_ref().and_then(status::canary_wait_note) {
            msg = format!("{msg}; {note}");
        }
        set_pending(&ctx, &obj, Phase::Suspended, &msg).await?;
        // However long it stays suspended, its Redis state is kept (spec.audit.retentionSeconds
        // is at least an hour).
        keep_state(&ctx, &obj).await;
        return Ok(Action::requeue(KEEP_SUSPENDED));
    }
    let replay = match resolve(&ctx.client, &obj).await {
        Ok(r) => r,
        Err(why) => {
            set_pending(&ctx, &obj, Phase::Pending, &why).await?;
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
    };
    let source = format!(
        "{}|{}",
        crate::redact::url(&replay.amqp_url),
        replay.spec.source.queue
    );
    let mut tasks = ctx.tasks.lock().await;
    if let Some((other, _)) = tasks.iter().find(|(_, t)| t.source == source) {
        let why = format!(
            "SourceBusy: replay {other} is replaying queue {}",
            replay.spec.source.queue
        );
        drop(tasks);
        set_pending(&ctx, &obj, Phase::Pending, &why).await?;
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    if tasks.len() >= ctx.settings.max_concurrent {
        let why = format!(
            "OperatorBusy: {} replays running (--max-concurrent-replays)",
            tasks.len()
        );
        drop(tasks);
        set_pending(&ctx, &obj, Phase::Pending, &why).await?;
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    let cancel = CancellationToken::new();
    let by_user = Arc::new(AtomicBool::new(false));
    let handle = tokio::spawn(drive(
        ctx.clone(),
        with_retry_recorded(obj),
        replay,
        cancel.clone(),
        by_user.clone(),
    ));
    tasks.insert(
        key,
        Task {
            source,
            cancel,
            by_user,
            handle,
        },
    );
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// A finished replay whose [`RETRY_ANNOTATION`] holds a value its status has not acted on yet
/// (`status.retriedFor`): a `Failed` or `CanaryFailed` one goes back to `Pending` under the same
/// replay id, and the next reconcile runs it again. The engine resumes it as a rerun would
/// (what is settled stays settled); a `CanaryFailed` one first has its stored end and canary
/// decisions removed from Redis, so it sends new canaries. `Done` (every selected message has
/// its outcome) and `Failed` with reason `InvalidSpec` (the spec is immutable, so it would fail
/// alike) are not retried: a Warning Event says why.
async fn retry_if_asked(ctx: &Context, obj: &DlqReplay) -> Result<Action, Error> {
    let status = obj.status.clone().unwrap_or_default();
    let Some(asked) = obj.annotations().get(RETRY_ANNOTATION).cloned() else {
        return Ok(Action::await_change());
    };
    if status.retried_for.as_deref() == Some(asked.as_str()) {
        return Ok(Action::await_change());
    }
    let phase = status.phase.unwrap_or(Phase::Pending);
    let refused = match phase {
        Phase::Done => Some("it is Done: every selected message has its outcome; what is left in the queue needs a new replay"),
        _ if status::reason_of(&status) == "InvalidSpec" => Some("its spec is invalid and immutable, so it would fail alike; create a new replay with a valid spec"),
        _ => None,
    };
    if let Some(why) = refused {
        let written = DlqReplayStatus {
            retried_for: Some(asked.clone()),
            ..status
        };
        write_status_once(ctx, obj, &written).await?;
        let note = format!("{RETRY_ANNOTATION}={asked:?} not acted on: {why}");
        emit(ctx, obj, true, "RetryRefused", Some(note)).await;
        return Ok(Action::await_change());
    }
    let replay = match resolve(&ctx.client, obj).await {
        Ok(r) => r,
        Err(why) => {
            tracing::warn!(replay = %key_of(obj), %why, "retry asked; trying again");
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
    };
    // Before the status says Pending: a retry whose status write fails is asked again, and
    // reopening twice changes nothing.
    let reopen = async {
        let mut con = engine::store::connect(&replay.redis_url).await?;
        engine::store::reopen(&mut con, &replay.namespace, &replay.state_name()).await
    };
    match tokio::time::timeout(API_CALL_TIMEOUT, reopen).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(replay = %key_of(obj), error = %e, "retry asked: reopening its Redis state; trying again");
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
        Err(_) => {
            tracing::warn!(replay = %key_of(obj), "retry asked: Redis did not answer within 5 s; trying again");
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
    }
    let canaries = if phase == Phase::CanaryFailed {
        "; new canaries go first"
    } else {
        ""
    };
    let pending = DlqReplayStatus {
        phase: Some(Phase::Pending),
        message: Some(format!(
            "Retrying: {RETRY_ANNOTATION}={asked:?} retries the {phase} replay in place, under the same replay id{canaries}"
        )),
        retried_for: Some(asked),
        finished_at: None,
        canary: if phase == Phase::CanaryFailed {
            Vec::new()
        } else {
            status.canary.clone()
        },
        ..status
    };
    write_status_once(ctx, obj, &pending).await?;
    Ok(Action::requeue(Duration::from_secs(1)))
}

/// A replay about to run with a [`RETRY_ANNOTATION`] value its status has not recorded (its
/// manifest carried one from the start): the value is recorded as acted on by its first status
/// write, so that only another value retries it once it ended.
fn with_retry_recorded(obj: Arc<DlqReplay>) -> Arc<DlqReplay> {
    let recorded = obj.status.as_ref().and_then(|s| s.retried_for.as_ref());
    match obj.annotations().get(RETRY_ANNOTATION) {
        Some(v) if recorded.is_none() => {
            let mut o = (*obj).clone();
            o.status.get_or_insert_with(Default::default).retried_for = Some(v.clone());
            Arc::new(o)
        }
        _ => obj,
    }
}

/// How often the Redis keys of a suspended replay get their full retention again.
const KEEP_SUSPENDED: Duration = Duration::from_secs(600);

/// Set the expiry of a replay's Redis keys to its retention from now; best effort (a replay
/// whose Secrets or Redis are not there has nothing to keep, or is kept at the next turn).
async fn keep_state(ctx: &Context, obj: &DlqReplay) {
    if obj.spec.dry_run {
        return;
    }
    let Ok(replay) = resolve(&ctx.client, obj).await else {
        return;
    };
    let keep = async {
        let mut con = engine::store::connect(&replay.redis_url).await?;
        let (ns, name) = (&replay.namespace, replay.state_name());
        engine::store::retain(&mut con, ns, &name, replay.spec.retention_seconds()).await
    };
    match tokio::time::timeout(API_CALL_TIMEOUT, keep).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, replay = %key_of(obj), "keeping the Redis state of a suspended replay")
        }
        Err(_) => {
            tracing::warn!(replay = %key_of(obj), "keeping the Redis state of a suspended replay: no answer within 5 s")
        }
    }
}

/// A spec the CRD's rules refuse (one an older CRD admitted) never starts: the replay ends
/// `Failed`, reason `InvalidSpec`, with the fields in its message (and its Degraded condition);
/// nothing is touched on the broker. A replay that already ended is left as it ended.
async fn refuse_invalid_spec(ctx: &Context, obj: &DlqReplay) -> Result<Option<Action>, Error> {
    let status = obj.status.clone().unwrap_or_default();
    if status.phase.is_some_and(Phase::is_terminal) {
        return Ok(None);
    }
    let errors = crate::manifest::validate_spec(&obj.spec);
    if errors.is_empty() {
        return Ok(None);
    }
    let fields: Vec<String> = errors.iter().map(ToString::to_string).collect();
    let failed = DlqReplayStatus {
        phase: Some(Phase::Failed),
        message: Some(format!(
            "InvalidSpec: {}; nothing was replayed: create a new replay with a valid spec",
            fields.join("; ")
        )),
        finished_at: Some(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
        ..status
    };
    write_status_once(ctx, obj, &failed).await?;
    Ok(Some(Action::await_change()))
}

async fn cleanup(obj: Arc<DlqReplay>, ctx: Arc<Context>) -> Result<Action, Error> {
    let task = ctx.tasks.lock().await.remove(&key_of(&obj));
    if let Some(t) = task {
        // The engine settles what is in flight, then stops; the rest stays in the DLQ.
        t.cancel.cancel();
        let _ = t.handle.await;
    }
    crate::metrics::Metrics::global().forget_replay(&obj.namespace_or_default(), &obj.name_any());
    Ok(Action::await_change())
}

/// An ended replay's spec may still change (`spec.suspend`, the one field that is not
/// immutable): that changes nothing, but its status is written again for the new generation, so
/// kstatus, Argo CD and `kubectl wait` do not read the replay as in progress for ever.
async fn observe_generation(ctx: &Context, obj: &DlqReplay) -> Result<(), Error> {
    let Some(status) = obj.status.as_ref() else {
        return Ok(());
    };
    if status.observed_generation == obj.meta().generation {
        return Ok(());
    }
    write_status_once(ctx, obj, status).await?;
    Ok(())
}

/// Write a waiting phase (Pending/Suspended) with its reason, only when it changed (a write
/// triggers another reconcile).
async fn set_pending(
    ctx: &Context,
    obj: &DlqReplay,
    phase: Phase,
    message: &str,
) -> Result<(), Error> {
    let mut status = obj.status.clone().unwrap_or_default();
    // Written again for a new generation (`spec.suspend` changed), so observedGeneration
    // follows the spec (kstatus and Argo CD read a status older than the spec as in progress).
    if status.phase == Some(phase)
        && status.message.as_deref() == Some(message)
        && status.observed_generation == obj.meta().generation
    {
        return Ok(());
    }
    status.phase = Some(phase);
    status.message = Some(message.to_string());
    write_status_once(ctx, obj, &status).await?;
    Ok(())
}

/// [`write_status`] from a reconcile: one attempt, and a failure fails the reconcile, whose
/// error policy tries again in 5 s (a reconcile must not hold a graceful shutdown for a status
/// retry budget).
async fn write_status_once(
    ctx: &Context,
    obj: &DlqReplay,
    next: &DlqReplayStatus,
) -> Result<DlqReplayStatus, Error> {
    let once = CancellationToken::new();
    once.cancel();
    write_status(ctx, obj, next, &once).await
}

/// Write `next` as the replay's status: a server-side apply of the whole status under
/// [`MANAGER`] (forced: the status is the operator's alone), with `observedGeneration` and
/// standard conditions that carry their own. A write that fails for a reason that may pass (the
/// API server unreachable or overloaded, a conflict) is tried again with backoff for up to
/// `settings.status_retry`, unless `stop` is cancelled first; then the error is returned: the
/// status was not written, and the caller must not assume it was. Metrics and events follow a
/// write that succeeded. Returns the status as written.
async fn write_status(
    ctx: &Context,
    obj: &DlqReplay,
    next: &DlqReplayStatus,
    stop: &CancellationToken,
) -> Result<DlqReplayStatus, Error> {
    let ns = obj.namespace_or_default();
    let api: Api<DlqReplay> = Api::namespaced(ctx.client.clone(), &ns);
    let generation = obj.meta().generation;
    let previous = obj
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let mut status = next.clone();
    status.observed_generation = generation;
    // The engine's statuses do not know which retry they run for: the operator's record stays.
    if status.retried_for.is_none() {
        status.retried_for = obj.status.as_ref().and_then(|s| s.retried_for.clone());
    }
    status.conditions = status::conditions(&status, &previous, generation, &status::now());
    let body = status::apply_body(&status);
    let params = PatchParams::apply(MANAGER).force();
    let started = Instant::now();
    let mut delays = engine::backoff(Duration::from_secs(4));
    // Each attempt is bounded: an API server that takes the connection and never answers must
    // not hold a shutdown for the client's read timeout (295 s).
    let (name, patch) = (obj.name_any(), Patch::Apply(&body));
    let attempt = || async {
        let write = api.patch_status(&name, &params, &patch);
        match tokio::time::timeout(API_CALL_TIMEOUT, write).await {
            Ok(written) => written.map(|_| ()),
            Err(_) => Err(kube::Error::Service("no answer within 5 s".into())),
        }
    };
    while let Err(e) = attempt().await {
        let delay = delays.next().unwrap_or(Duration::from_secs(4));
        let budget_left = started.elapsed() + delay <= ctx.settings.status_retry;
        if !status::worth_retrying(&e) || !budget_left || stop.is_cancelled() {
            return Err(e.into());
        }
        tracing::warn!(error = %e, replay = %key_of(obj), retry_in_ms = delay.as_millis() as u64, "writing status; trying again");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.cancelled() => return Err(e.into()),
        }
    }
    let old_phase = obj.status.as_ref().and_then(|s| s.phase);
    let metrics = crate::metrics::Metrics::global();
    metrics.count(
        &obj.status.clone().unwrap_or_default().counts,
        &status.counts,
    );
    metrics.phase_change(old_phase, status.phase);
    metrics.observe_replay(
        &ns,
        &name,
        Some(&status),
        obj.spec.poison.max_quarantine_ratio,
    );
    if old_phase != status.phase {
        publish_event(ctx, obj, &status).await;
    }
    let old_canaries = obj
        .status
        .as_ref()
        .map(|s| s.canary.clone())
        .unwrap_or_default();
    for (signature, result, reason) in status::canary_changes(&old_canaries, &status.canary) {
        let warning = matches!(result, CanaryResult::DiedAgain | CanaryResult::Unconfirmed);
        let note = format!(
            "canary of {signature}: {result:?}{}",
            reason.map(|r| format!(" ({r})")).unwrap_or_default()
        );
        emit(ctx, obj, warning, &format!("Canary{result:?}"), Some(note)).await;
    }
    Ok(status)
}

async fn emit(ctx: &Context, obj: &DlqReplay, warning: bool, reason: &str, note: Option<String>) {
    let ev = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.into(),
        note,
        action: "Replay".into(),
        secondary: None,
    };
    let reference = obj.object_ref(&());
    let publish = ctx.recorder.publish(&ev, &reference);
    match tokio::time::timeout(API_CALL_TIMEOUT, publish).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "publishing an event"),
        Err(_) => tracing::warn!("publishing an event: no answer within 5 s"),
    }
}

async fn publish_event(ctx: &Context, obj: &DlqReplay, status: &DlqReplayStatus) {
    let phase = status.phase.unwrap_or(Phase::Pending);
    let warning = matches!(phase, Phase::Failed | Phase::CanaryFailed);
    emit(
        ctx,
        obj,
        warning,
        &phase.to_string(),
        status.message.clone(),
    )
    .await;
}

/// What the operator stopping a replay (not the user) leaves in its status: `Pending`, because
/// the replay waits for an operator to lead again and resume it; `Suspended` would read as the
/// user's `spec.suspend`.
fn operator_stopped(status: DlqReplayStatus) -> DlqReplayStatus {
    let canary = status::canary_wait_note(&status)
        .map(|n| format!("; {n}"))
        .unwrap_or_default();
    let message = format!(
        "OperatorStopped: the operator stopped (shutdown or lost lease) after the in-flight messages settled; the next operator to lead resumes it{canary}; so far {}",
        engine::summary(&status.counts)
    );
    DlqReplayStatus {
        phase: Some(Phase::Pending),
        message: Some(message),
        ..status
    }
}

/// Run the engine for one replay, writing its status as it goes. `by_user` is set when the
/// stop that `cancel` brings is the user's `spec.suspend`.
async fn drive(
    ctx: Arc<Context>,
    obj: Arc<DlqReplay>,
    replay: Replay,
    cancel: CancellationToken,
    by_user: Arc<AtomicBool>,
) {
    let key = key_of(&obj);
    let (tx, mut rx) = watch::channel(obj.status.clone().unwrap_or_default());
    // spec.audit.retentionSeconds: the keys' expiry is kept while it runs and set at its end.
    let retention = engine::store::retention(&replay, tx.subscribe());
    let writer_ctx = ctx.clone();
    let writer_obj = obj.clone();
    let interval = ctx.settings.status_interval;
    // Ends the retries of a progress write once the engine is done: the final write follows.
    let writer_stop = cancel.child_token();
    let writer_cancel = writer_stop.clone();
    let writer = tokio::spawn(async move {
        let mut current = (*writer_obj).clone();
        let mut last_at = Instant::now();
        let mut last: Option<DlqReplayStatus> = None;
        loop {
            let changed = tokio::time::timeout(interval, rx.changed()).await;
            if matches!(changed, Ok(Err(_))) {
                break;
            }
            let next = rx.borrow_and_update().clone();
            let elapsed = last_at.elapsed().as_millis();
            if status::should_write(last.as_ref(), &next, elapsed, interval.as_millis()) {
                match write_status(&writer_ctx, &current, &next, &writer_cancel).await {
                    Ok(written) => {
                        current.status = Some(written);
                        last = Some(next);
                        last_at = Instant::now();
                    }
                    // Not written, so not assumed: `last` stays, and the next turn (at most
                    // `interval` later) writes the newest status, a phase change included.
                    Err(e) => {
                        tracing::warn!(error = %e, replay = %key_of(&current), "writing status")
                    }
                }
            }
        }
        current
    });
    let result = engine::run(&replay, &ctx.settings.engine, &tx, &cancel).await;
    drop(tx);
    writer_stop.cancel();
    let current = writer.await.unwrap_or_else(|_| (*obj).clone());
    // A stop that is not the user's suspend (shutdown, lost lease, deletion) leaves what did not
    // end waiting for the next operator: Pending/OperatorStopped, whether the engine stopped
    // draining (Suspended), waiting for its pre-flight (Pending) or waiting on its canaries.
    let operator_stop = cancel.is_cancelled() && !by_user.load(Ordering::SeqCst);
    let final_status = match result {
        Ok(s) if operator_stop && !s.phase.is_some_and(Phase::is_terminal) => operator_stopped(s),
        Ok(s) => s,
        Err(_) if operator_stop => operator_stopped(current.status.clone().unwrap_or_default()),
        Err(e) => DlqReplayStatus {
            phase: Some(Phase::Pending),
            message: Some(format!("Unavailable: {e}; retrying")),
            ..current.status.clone().unwrap_or_default()
        },
    };
    if current.status.as_ref() != Some(&final_status) {
        // Not cancellable (the task is being stopped already), bounded by status_retry.
        if let Err(e) = write_status(&ctx, &current, &final_status, &CancellationToken::new()).await
        {
            tracing::warn!(error = %e, replay = %key, "writing the final status");
        }
    }
    if let Some(expiry) = retention {
        // Bounded: a Redis that does not answer must not hold a shutdown.
        let _ = tokio::time::timeout(API_CALL_TIMEOUT, expiry).await;
    }
    ctx.tasks.lock().await.remove(&key);
    tracing::info!(replay = %key, phase = ?final_status.phase, "replay task ended");
}

/// Resolve the Secret references of a replay into URLs; the error says which is missing.
pub async fn resolve(client: &Client, obj: &DlqReplay) -> Result<Replay, String> {
    let ns = obj.namespace_or_default();
    let spec = &obj.spec;
    let amqp_url = url_of(client, &ns, &spec.broker, "spec.broker").await?;
    let redis = spec
        .idempotency
        .as_ref()
        .and_then(|i| i.redis.as_ref().map(|r| (r, "spec.idempotency.redis")))
        .or_else(|| {
            spec.audit
                .as_ref()
                .and_then(|a| a.redis.as_ref().map(|r| (r, "spec.audit.redis")))
        })
        .ok_or_else(|| "NoRedis: set spec.idempotency.redis or spec.audit.redis".to_string())?;
    let redis_url = url_of(client, &ns, redis.0, redis.1).await?;
    Ok(Replay {
        namespace: ns,
        name: obj.name_any(),
        spec: spec.clone(),
        amqp_url,
        redis_url,
        uid: obj.uid(),
    })
}

async fn url_of(
    client: &Client,
    ns: &str,
    c: &ConnectionSpec,
    path: &str,
) -> Result<String, String> {
    if let Some(u) = &c.url {
        return Ok(u.clone());
    }
    let Some(r) = &c.url_secret_ref else {
        return Err(format!("NoUrl: {path} has neither url nor urlSecretRef"));
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret = secrets
        .get_opt(&r.name)
        .await
        .map_err(|e| {
            format!(
                "SecretUnreadable: Secret {ns}/{} ({path}.urlSecretRef): {e}",
                r.name
            )
        })?
        .ok_or_else(|| {
            format!(
                "SecretMissing: Secret {ns}/{} ({path}.urlSecretRef) does not exist",
                r.name
            )
        })?;
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|b| String::from_utf8_lossy(&b.0).trim().to_string())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(&r.key).cloned())
        })
        .ok_or_else(|| {
            format!(
                "SecretKeyMissing: Secret {ns}/{} has no key {:?} ({path}.urlSecretRef)",
                r.name, r.key
            )
        })?;
    Ok(value)
}
