//! The canary stage of a pass: Pending → Canary. Check the ground, send one canary per failure
//! signature, watch for returns, decide what the drain may take.

use super::{add, canary, proven, store};
use crate::pass::Pass;
use crate::status::Phase;
use crate::Error;

pub(crate) enum CanaryEnd {
    /// Drain the signatures the canaries proved.
    Drain(proven::Proven),
    /// Do not drain: the status says why.
    Stop,
}

/// Pending → Canary: check the ground, send one canary per signature, watch, decide.
pub(crate) async fn canary_phase(pass: &mut Pass<'_>) -> Result<CanaryEnd, Error> {
    let (replay, opts, progress, cancel) = (pass.replay, pass.opts, pass.progress, pass.cancel);
    let (conn, state) = (&pass.conn, &pass.state);
    let (publisher, store, status) = (&mut pass.publisher, &mut pass.store, &mut pass.status);
    let spec = &replay.spec;
    if let Some(json) = &state.canary {
        // A resumed replay keeps the decisions its canaries already made.
        status.canary = serde_json::from_str(json)
            .map_err(|e| Error::Redis(format!("stored canary results: {e}")))?;
        return Ok(CanaryEnd::Drain(proven::Proven::of(&status.canary)));
    }
    if !spec.canary.enabled {
        return Ok(CanaryEnd::Drain(proven::Proven::All));
    }
    let claim_value = store::claim_value(&state.replay_id, state.attempt);
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
            canary::Selection::Nothing => return Ok(CanaryEnd::Drain(proven::Proven::All)),
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
    let proven = proven::Proven::of(&watch.canaries);
    if proven.none_passed() {
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
    Ok(CanaryEnd::Drain(proven))
}
