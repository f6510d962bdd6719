//! `spec.requireApproval`: the plan made in the cluster, the approval annotation that names it,
//! and the limits an approved plan sets on the replay.
//!
//! A replay that requires approval is planned (read-only, as `dlq-replay plan`) before anything
//! moves; the plan goes to `status.plan` and the replay waits in `AwaitingApproval`. The
//! annotation `replay.dlq.dev/approve` set to the plan's digest approves it: the operator plans
//! again, and only when the queue and the decisions are the same (the same digest) does the
//! replay start, bound to that plan (its signatures and counts, as `spec.expect` would bind
//! it). A digest that is not the current plan's is refused with a Warning Event, and the new
//! plan is written for its own approval.

use kube::runtime::controller::Action;
use kube::ResourceExt;

use crate::api::{DlqReplay, DlqReplayStatus, Phase, PlanStatus, ReplayStatus, APPROVE_ANNOTATION};
use crate::engine::{self, Replay};

use super::writes::{emit, set_pending, write_status_once};
use super::{key_of, Context, Error};

/// What reconcile does with a replay that requires approval.
pub(super) enum Approval {
    /// Approved: run it, within the approved plan; with the status the approval wrote, which the
    /// replay's own writes must keep.
    Run(Box<Replay>, Option<Box<DlqReplayStatus>>),
    /// Not approved (yet): nothing moves.
    Wait(Action),
}

/// Plan, wait, or let the replay run within its approved plan.
pub(super) async fn gate(
    ctx: &Context,
    obj: &DlqReplay,
    replay: Replay,
) -> Result<Approval, Error> {
    let status = obj.status.clone().unwrap_or_default();
    let asked = obj.annotations().get(APPROVE_ANNOTATION).cloned();
    match (&status.approved_digest, &status.plan) {
        // Approved before (an operator restart, a retry): the same plan binds it.
        (Some(d), Some(plan)) if &plan.digest == d => {
            return Ok(Approval::Run(bound(replay, plan), None))
        }
        _ => {}
    }
    let fresh_ask = asked.filter(|a| status.approval_refused_for.as_ref() != Some(a));
    let Some(asked) = fresh_ask else {
        if let Some(plan) = status.plan.clone() {
            // Still waiting; after a suspend and a resume the status says so again.
            if status.phase == Some(Phase::AwaitingApproval) {
                return Ok(Approval::Wait(Action::await_change()));
            }
            return waiting(ctx, obj, status, plan, None).await;
        }
        return match make_plan(ctx, obj, &replay).await? {
            Ok(plan) => waiting(ctx, obj, status, plan, None).await,
            Err(wait) => Ok(wait),
        };
    };
    // Planned again: an approval holds only for what the queue holds now. A digest the
    // manifest carried from the start (from `dlq-replay plan`, reviewed in the pull request)
    // approves as well, when the queue still gives it.
    let plan = match make_plan(ctx, obj, &replay).await? {
        Ok(plan) => plan,
        Err(wait) => return Ok(wait),
    };
    if asked == plan.digest {
        let approved = DlqReplayStatus {
            replay: ReplayStatus {
                phase: Some(Phase::Pending),
                message: Some(format!(
                    "Approved: plan {} ({APPROVE_ANNOTATION}); replaying within it",
                    plan.digest
                )),
                ..status.replay.clone()
            },
            approved_digest: Some(plan.digest.clone()),
            plan: Some(plan.clone()),
            ..status
        };
        let written = write_status_once(ctx, obj, &approved).await?;
        let note = format!("plan {} approved; the replay starts within it", plan.digest);
        emit(ctx, obj, false, "Approved", Some(note)).await;
        return Ok(Approval::Run(bound(replay, &plan), Some(Box::new(written))));
    }
    let why = match &status.plan {
        Some(old) if old.digest != asked => format!(
            "{APPROVE_ANNOTATION}={asked:?} is not the digest of the plan waiting for approval ({})",
            old.digest
        ),
        _ => format!("the dead-letter queue (or its decisions) changed since plan {asked} was made"),
    };
    let note = format!(
        "approval refused: {why}; plan {} waits for approval",
        plan.digest
    );
    emit(ctx, obj, true, "ApprovalRefused", Some(note)).await;
    waiting(ctx, obj, status, plan, Some(asked)).await
}

/// Write the plan waiting for approval (and the refused digest, when one was).
async fn waiting(
    ctx: &Context,
    obj: &DlqReplay,
    status: DlqReplayStatus,
    plan: PlanStatus,
    refused: Option<String>,
) -> Result<Approval, Error> {
    let message = format!(
        "AwaitingApproval: plan {} {} of {} messages; approve it with `kubectl dlqreplay approve {}` (or annotate {APPROVE_ANNOTATION}={})",
        plan.digest,
        plan.counts.would(),
        plan.depth,
        obj.name_any(),
        plan.digest
    );
    let next = DlqReplayStatus {
        replay: ReplayStatus {
            phase: Some(Phase::AwaitingApproval),
            message: Some(message),
            ..status.replay.clone()
        },
        approval_refused_for: refused.or(status.approval_refused_for.clone()),
        plan: Some(plan),
        ..status
    };
    write_status_once(ctx, obj, &next).await?;
    Ok(Approval::Wait(Action::await_change()))
}

/// Plan the replay as `dlq-replay plan` does: nothing moves. A plan that cannot be made (the
/// broker or Redis unreachable, the queue missing) leaves the replay Pending, saying why, and
/// is tried again.
async fn make_plan(
    ctx: &Context,
    obj: &DlqReplay,
    replay: &Replay,
) -> Result<Result<PlanStatus, Approval>, Error> {
    match engine::plan::plan(replay).await {
        Ok(r) => Ok(Ok(PlanStatus {
            digest: r.digest,
            planned_at: engine::now(),
            depth: r.depth,
            counts: r.counts,
            by_signature: r.by_signature,
        })),
        Err(e) => {
            tracing::warn!(replay = %key_of(obj), error = %e, "planning for approval");
            let why = format!("planning for approval: {e}");
            set_pending(ctx, obj, Phase::Pending, &why).await?;
            Ok(Err(Approval::Wait(Action::requeue(
                std::time::Duration::from_secs(5),
            ))))
        }
    }
}

/// The replay bound to its approved plan: `spec.expect` narrowed to the plan's signatures and
/// counts.
fn bound(mut replay: Replay, plan: &PlanStatus) -> Box<Replay> {
    let approved = engine::plan::approved(&plan.counts, &plan.by_signature);
    replay.spec.expect = Some(engine::plan::bound(replay.spec.expect.as_ref(), approved));
    Box::new(replay)
}
