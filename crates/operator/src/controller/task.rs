//! One replay's task: the engine run, its status written as it goes, its end.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::{DlqReplay, DlqReplayStatus, Phase, ReplayStatus};
use crate::engine::{self, Replay};

use super::writes::write_status;
use super::{key_of, status, Context, API_CALL_TIMEOUT};

/// What the operator stopping a replay (not the user) leaves in its status: `Pending`, because
/// the replay waits for an operator to lead again and resume it; `Suspended` would read as the
/// user's `spec.suspend`.
pub(super) fn operator_stopped(status: ReplayStatus) -> ReplayStatus {
    let canary = status::canary_wait_note(&status)
        .map(|n| format!("; {n}"))
        .unwrap_or_default();
    let message = format!(
        "OperatorStopped: the operator stopped (shutdown or lost lease) after the in-flight messages settled; the next operator to lead resumes it{canary}; so far {}",
        engine::summary(&status.counts)
    );
    ReplayStatus {
        phase: Some(Phase::Pending),
        message: Some(message),
        ..status
    }
}

/// Run the engine for one replay, writing its status as it goes. `by_user` is set when the
/// stop that `cancel` brings is the user's `spec.suspend`.
pub(super) async fn drive(
    ctx: Arc<Context>,
    obj: Arc<DlqReplay>,
    replay: Replay,
    cancel: CancellationToken,
    by_user: Arc<AtomicBool>,
) {
    let key = key_of(&obj);
    // The engine reports its own status; the operator's fields (conditions, the generation, the
    // retry acted on) are added to it when it is written.
    let known = obj.status.clone().map(|s| s.replay).unwrap_or_default();
    let (tx, mut rx) = watch::channel(known);
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
        let mut last: Option<ReplayStatus> = None;
        loop {
            let changed = tokio::time::timeout(interval, rx.changed()).await;
            if matches!(changed, Ok(Err(_))) {
                break;
            }
            let next = rx.borrow_and_update().clone();
            let elapsed = last_at.elapsed().as_millis();
            if status::should_write(last.as_ref(), &next, elapsed, interval.as_millis()) {
                let written = DlqReplayStatus::from(next.clone());
                match write_status(&writer_ctx, &current, &written, &writer_cancel).await {
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
    let last_written = current.status.clone().unwrap_or_default().replay;
    let final_status = DlqReplayStatus::from(match result {
        Ok(s) if operator_stop && !s.phase.is_some_and(Phase::is_terminal) => operator_stopped(s),
        Ok(s) => s,
        Err(_) if operator_stop => operator_stopped(last_written),
        Err(e) => ReplayStatus {
            phase: Some(Phase::Pending),
            message: Some(format!("Unavailable: {e}; retrying")),
            ..last_written
        },
    });
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
