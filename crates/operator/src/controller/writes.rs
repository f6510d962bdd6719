//! What the operator writes about a replay: its status (server-side apply, retried within
//! bounds) and its Events.

use std::time::{Duration, Instant};

use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::api::{CanaryResult, DlqReplay, DlqReplayStatus, Phase};
use crate::engine;

use super::{key_of, status, Context, Error, API_CALL_TIMEOUT, MANAGER};

/// An ended replay's spec may still change (`spec.suspend`, the one field that is not
/// immutable): that changes nothing, but its status is written again for the new generation, so
/// kstatus, Argo CD and `kubectl wait` do not read the replay as in progress for ever.
pub(super) async fn observe_generation(ctx: &Context, obj: &DlqReplay) -> Result<(), Error> {
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
pub(super) async fn set_pending(
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
pub(super) async fn write_status_once(
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
pub(super) async fn write_status(
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
    // Nor which plan was approved: what the approval wrote stays (an apply without them would
    // remove them).
    if let Some(old) = obj.status.as_ref() {
        if status.plan.is_none() {
            status.plan.clone_from(&old.plan);
        }
        if status.approved_digest.is_none() {
            status.approved_digest.clone_from(&old.approved_digest);
        }
        if status.approval_refused_for.is_none() {
            status
                .approval_refused_for
                .clone_from(&old.approval_refused_for);
        }
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

pub(super) async fn emit(
    ctx: &Context,
    obj: &DlqReplay,
    warning: bool,
    reason: &str,
    note: Option<String>,
) {
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

pub(super) async fn publish_event(ctx: &Context, obj: &DlqReplay, status: &DlqReplayStatus) {
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
