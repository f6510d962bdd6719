//! `spec.requireApproval`: the operator plans in the cluster and waits; an approval that names
//! another plan, or a plan the queue no longer matches, is refused with an Event and a new plan
//! is written; the current digest starts the replay, bound to that plan.

use super::*;

pub(crate) async fn annotate_approve(api: &Api<DlqReplay>, name: &str, value: &str) {
    let patch = json!({"metadata": {"annotations": {dlq_replay::api::APPROVE_ANNOTATION: value}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

fn digest(r: &DlqReplay) -> String {
    r.status
        .as_ref()
        .and_then(|s| s.plan.as_ref())
        .map(|p| p.digest.clone())
        .unwrap_or_default()
}

pub(crate) async fn a_replay_that_requires_approval_waits_refuses_a_stale_digest_and_runs_on_the_current_one(
    c: &Cluster,
) {
    let w = World::new("ctl-approve").await;
    w.dead_letter((0..20).map(|i| job(&format!("a{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let r = resource(&w, c.ns(), "approve", "  requireApproval: true\n");
    api.create(&PostParams::default(), &r).await.unwrap();
    let waiting = wait_for(&api, "approve", "AwaitingApproval", |r| {
        phase(r) == Some(Phase::AwaitingApproval)
    })
    .await;
    let s = waiting.status.clone().unwrap();
    let plan = s.plan.clone().expect("status.plan");
    assert_eq!((plan.depth, plan.counts.replayed), (20, 20), "{plan:?}");
    assert!(plan.digest.starts_with("sha256:"), "{plan:?}");
    assert!(
        s.message
            .as_deref()
            .unwrap_or("")
            .starts_with("AwaitingApproval: plan"),
        "{s:?}"
    );
    // kstatus: in progress, not ready.
    assert_eq!(condition(&waiting, "Reconciling").as_deref(), Some("True"));
    assert_eq!(condition(&waiting, "Ready").as_deref(), Some("False"));
    // Nothing moved while it waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(w.depth(&w.topo.dlq).await, 20);
    assert_eq!(w.depth(&w.topo.work).await, 0);

    // Suspended and resumed while it waits: it waits again, for the same plan.
    let suspend = |on: bool| json!({"spec": {"suspend": on}});
    api.patch(
        "approve",
        &PatchParams::default(),
        &Patch::Merge(&suspend(true)),
    )
    .await
    .unwrap();
    wait_for(&api, "approve", "Suspended", |r| {
        phase(r) == Some(Phase::Suspended)
    })
    .await;
    api.patch(
        "approve",
        &PatchParams::default(),
        &Patch::Merge(&suspend(false)),
    )
    .await
    .unwrap();
    let again = wait_for(&api, "approve", "AwaitingApproval again", |r| {
        phase(r) == Some(Phase::AwaitingApproval)
    })
    .await;
    assert_eq!(digest(&again), plan.digest);

    // A digest that is not the plan's: refused.
    annotate_approve(&api, "approve", "sha256:0000").await;
    let refused = wait_for(&api, "approve", "the refusal recorded", |r| {
        r.status
            .as_ref()
            .and_then(|s| s.approval_refused_for.as_deref())
            == Some("sha256:0000")
    })
    .await;
    assert_eq!(phase(&refused), Some(Phase::AwaitingApproval));
    assert_eq!(digest(&refused), plan.digest, "the queue did not change");
    let events = events_once(c, |e| reasons(e).contains(&"ApprovalRefused".to_string())).await;
    assert!(
        reasons(&events).contains(&"ApprovalRefused".to_string()),
        "{events:?}"
    );

    // The queue changes after the plan was read; its digest is stale now.
    w.dead_letter(vec![job("late", json!({}))]).await;
    annotate_approve(&api, "approve", &plan.digest).await;
    let replanned = wait_for(&api, "approve", "a new plan", |r| {
        !digest(r).is_empty() && digest(r) != plan.digest
    })
    .await;
    assert_eq!(phase(&replanned), Some(Phase::AwaitingApproval));
    let new_plan = replanned.status.clone().unwrap().plan.unwrap();
    assert_eq!(
        (new_plan.depth, new_plan.counts.replayed),
        (21, 21),
        "{new_plan:?}"
    );
    assert_eq!(
        w.depth(&w.topo.work).await,
        0,
        "nothing moves on a stale approval"
    );

    // The current digest: it runs, within that plan.
    annotate_approve(&api, "approve", &new_plan.digest).await;
    let done = wait_for(&api, "approve", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = done.status.clone().unwrap();
    assert_eq!(s.approved_digest.as_deref(), Some(new_plan.digest.as_str()));
    assert_eq!(s.counts.replayed, 21, "{s:?}");
    assert_eq!(
        s.plan.as_ref().map(|p| p.digest.clone()),
        Some(new_plan.digest.clone())
    );
    assert_eq!(w.take(&w.topo.work).await.len(), 21);
    let events = events_once(c, |e| reasons(e).contains(&"Approved".to_string())).await;
    assert!(
        reasons(&events).contains(&"Approved".to_string()),
        "{events:?}"
    );
    w.cleanup().await;
}

/// A manifest that carries the approval from the start (the digest `dlq-replay plan` printed,
/// reviewed in the pull request) runs at once when the queue still gives that digest.
pub(crate) async fn an_approval_reviewed_in_the_manifest_runs_when_the_queue_still_matches(
    c: &Cluster,
) {
    let w = World::new("ctl-approved").await;
    w.dead_letter((0..8).map(|i| job(&format!("m{i}"), json!({}))).collect())
        .await;
    // The author's plan, out of the cluster, on the same queue and rules.
    let report =
        dlq_replay::engine::plan::plan(&w.replay(&w.manifest("  requireApproval: true\n")))
            .await
            .unwrap();
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let mut r = resource(&w, c.ns(), "reviewed", "  requireApproval: true\n");
    r.metadata.annotations = Some(
        [(
            dlq_replay::api::APPROVE_ANNOTATION.to_string(),
            report.digest.clone(),
        )]
        .into(),
    );
    api.create(&PostParams::default(), &r).await.unwrap();
    let done = wait_for(&api, "reviewed", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = done.status.unwrap();
    assert_eq!(s.approved_digest.as_deref(), Some(report.digest.as_str()));
    assert_eq!(s.counts.replayed, 8, "{s:?}");
    w.cleanup().await;
}

/// `spec.expect` through the operator: the signature not approved stays in the DLQ (listed in
/// `status.notApproved`), and the maximum stops the replay `Failed` with its reason.
pub(crate) async fn a_replay_with_limits_replays_only_the_approved_signatures_and_stops_at_the_maximum(
    c: &Cluster,
) {
    let w = World::new("ctl-expect").await;
    let jobs = (0..12)
        .map(|i| {
            let id = format!("x{i:02}");
            let kind = if i % 3 == 0 {
                "KeyError"
            } else {
                "TimeoutError"
            };
            dlq_replay::fixture::job(&id, json!({ "id": id }), kind)
        })
        .collect();
    w.dead_letter(jobs).await;
    let before = w.peek(&w.topo.dlq).await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let extra = "  expect:\n    signatures: [x-exception-type=TimeoutError]\n    maxReplayed: 6\n";
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "limits", extra),
    )
    .await
    .unwrap();
    let failed = wait_for(&api, "limits", "Failed", |r| {
        phase(r) == Some(Phase::Failed)
    })
    .await;
    let s = failed.status.unwrap();
    let msg = s.message.clone().unwrap_or_default();
    assert!(
        msg.starts_with("ExpectationReached: spec.expect.maxReplayed is 6"),
        "{msg}"
    );
    assert_eq!(s.counts.replayed, 6, "{s:?}");
    assert!(
        s.not_approved.contains_key("x-exception-type=KeyError"),
        "{s:?}"
    );
    let replayed: Vec<String> = before
        .iter()
        .filter(|m| header(m, "x-exception-type").as_deref() == Some("TimeoutError"))
        .take(6)
        .map(|m| m.id.clone())
        .collect();
    assert_eq!(ids(&w.take(&w.topo.work).await), replayed);
    // Everything else is still in the DLQ, byte for byte.
    let mut left = w.peek(&w.topo.dlq).await;
    let mut rest: Vec<Seen> = before
        .into_iter()
        .filter(|m| !replayed.contains(&m.id))
        .collect();
    left.sort_by(|a, b| a.id.cmp(&b.id));
    rest.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(left, rest);
    w.cleanup().await;
}
