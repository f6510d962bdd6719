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
//!
//! By concern: this module holds the `Context`, `reconcile` and `error_policy` and the steps of
//! reconcile; `leader` (who drives replays, and the shutdown signals), `lease` (the Lease
//! itself), `task` (one replay's engine run and its status as it goes), `writes` (status writes
//! and Events), `status` (what a status says: conditions, phases), `secrets` (URLs from Secrets).

mod approval;
mod leader;
pub mod lease;
mod secrets;
pub mod status;
mod task;
mod writes;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::finalizer::{finalizer, Event as Finalizer};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::api::{DlqReplay, DlqReplayStatus, Phase, ReplayStatus, RETRY_ANNOTATION};
use crate::engine;

use leader::CONTROLLER_PART;
pub use leader::{run_with_leader_election, signalled};
pub use secrets::resolve;
use task::drive;
use writes::{emit, observe_generation, set_pending, write_status_once};

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
        if let Some(note) = obj.status.as_deref().and_then(status::canary_wait_note) {
            msg = format!("{msg}; {note}");
        }
        set_pending(&ctx, &obj, Phase::Suspended, &msg).await?;
        // However long it stays suspended, its Redis state is kept (spec.audit.retentionSeconds
        // is at least an hour).
        keep_state(&ctx, &obj).await;
        return Ok(Action::requeue(KEEP_SUSPENDED));
    }
    let mut replay = match resolve(&ctx.client, &obj).await {
        Ok(r) => r,
        Err(why) => {
            set_pending(&ctx, &obj, Phase::Pending, &why).await?;
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
    };
    let mut obj = obj;
    if obj.spec.require_approval && !obj.spec.dry_run {
        match approval::gate(&ctx, &obj, replay).await? {
            approval::Approval::Run(bound, written) => {
                replay = *bound;
                if let Some(status) = written {
                    let mut o = (*obj).clone();
                    o.status = Some(*status);
                    obj = Arc::new(o);
                }
            }
            approval::Approval::Wait(action) => return Ok(action),
        }
    }
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
    let canary = if phase == Phase::CanaryFailed {
        Vec::new()
    } else {
        status.canary.clone()
    };
    let pending = DlqReplayStatus {
        replay: ReplayStatus {
            phase: Some(Phase::Pending),
            message: Some(format!(
                "Retrying: {RETRY_ANNOTATION}={asked:?} retries the {phase} replay in place, under the same replay id{canaries}"
            )),
            finished_at: None,
            canary,
            ..status.replay
        },
        retried_for: Some(asked),
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
        replay: ReplayStatus {
            phase: Some(Phase::Failed),
            message: Some(format!(
                "InvalidSpec: {}; nothing was replayed: create a new replay with a valid spec",
                fields.join("; ")
            )),
            finished_at: Some(
                chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            ),
            ..status.replay
        },
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
