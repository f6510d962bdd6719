//! Check and Claim mode end to end: every message decided, the invariants kept, poison
//! quarantined with its headers and a reason, each key published once, a finished replay run again.

use super::*;

matrix!(check_mode_decides_every_message_and_keeps_the_invariants);
async fn check_mode_decides_every_message_and_keeps_the_invariants(t: Target) {
    let w = World::on("check", &t).await;
    let mut jobs = Vec::new();
    for i in 0..20 {
        jobs.push(job(&format!("ok-{i}"), json!({"show": "daily"})));
    }
    for i in 0..4 {
        jobs.push(job(&format!("done-{i}"), json!({"show": "daily"})));
    }
    for i in 0..3 {
        jobs.push(job(&format!("weekly-{i}"), json!({"show": "weekly"})));
    }
    // Poison: a missing required field, and a body that is not JSON at all.
    jobs.push(job("nofield", json!({"show": "daily", "drop": "asset"})));
    let mut bin = job("binary", json!({}));
    bin.1 = vec![0xff, 0xfe, 0x00, 0x01];
    jobs.push(bin);
    w.dead_letter(jobs).await;
    for i in 0..4 {
        w.set(&w.key(&format!("done-{i}")), "done").await;
    }
    let dlq_before = by_id(&w.peek(&w.topo.dlq).await);
    let spec = format!(
        "  selector: {{payload: [{{pointer: /show, equals: daily}}]}}\n  poison: {{maxDeathCount: 3}}\n{}",
        w.idempotency("Check")
    );
    let resource = w.manifest(&spec.replace(
        "maxDeathCount: 3",
        "maxDeathCount: 3, requiredFields: [/show]",
    ));
    let status = w.run(&resource).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    let c = status.counts;
    // `binary` is not JSON: the selector cannot match it, so it is skipped, not replayed.
    // `nofield` lacks nothing the selector or poison gate needs: it is replayed.
    assert_eq!(
        (
            c.scanned,
            c.replayed,
            c.duplicates,
            c.quarantined,
            c.skipped,
            c.failed
        ),
        (29, 21, 4, 0, 4, 0),
        "{c:?}"
    );
    assert_sum(&status);
    assert_eq!(status.source_depth_at_start, Some(29));

    let replay_id = status.replay_id.clone().unwrap();
    let target = w.take(&w.topo.work).await;
    let quarantine = w.take(&w.topo.quarantine).await;
    let dlq_after = w.peek(&w.topo.dlq).await;
    let audit = w.audit(&status).await;
    assert_eq!(audit.len() as u64, c.scanned - c.skipped);
    assert_eq!(status.audit.as_ref().unwrap().records, audit.len() as u64);

    // Replayed: death headers gone, tagged, everything else and the body unchanged.
    assert_eq!(target.len(), 21);
    for m in &target {
        let orig = &dlq_before[&m.id];
        assert_eq!(m.body, orig.body, "{}", m.id);
        assert!(!m.headers.contains_key("x-death"));
        assert!(!m
            .headers
            .inner()
            .keys()
            .any(|k| k.as_str().starts_with("x-first-death")
                || k.as_str().starts_with("x-last-death")));
        assert_eq!(
            header(m, "x-replay-id").as_deref(),
            Some(replay_id.as_str())
        );
        assert_eq!(header(m, "x-replay-count").as_deref(), Some("1"));
        assert_eq!(header(m, "x-idempotency-key"), Some(w.key(&m.id)));
        assert_eq!(
            header(m, "x-exception-type").as_deref(),
            Some("TimeoutError")
        );
        assert_eq!(m.props.content_type(), orig.props.content_type());
        assert_eq!(m.props.delivery_mode(), orig.props.delivery_mode());
    }
    assert!(quarantine.is_empty());
    // Skipped: still in the DLQ, byte for byte, header for header, in their relative order.
    assert_eq!(
        ids(&dlq_after),
        vec!["weekly-0", "weekly-1", "weekly-2", "binary"]
    );
    for m in &dlq_after {
        assert_eq!(m, &dlq_before[&m.id]);
    }
    // Every message that was in the DLQ is in exactly one place.
    let mut places: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for m in &target {
        places.entry(m.id.clone()).or_default().push("target");
    }
    for m in &dlq_after {
        places.entry(m.id.clone()).or_default().push("dlq");
    }
    for r in audit.iter().filter(|r| r.decision == "duplicate") {
        places
            .entry(r.message.clone())
            .or_default()
            .push("duplicate");
    }
    assert_eq!(
        places.keys().cloned().collect::<BTreeSet<_>>(),
        dlq_before.keys().cloned().collect()
    );
    for (id, p) in &places {
        assert_eq!(p.len(), 1, "{id} is in {p:?}");
    }
    let dups: BTreeSet<String> = audit
        .iter()
        .filter(|r| r.decision == "duplicate")
        .map(|r| r.message.clone())
        .collect();
    assert_eq!(dups, (0..4).map(|i| format!("done-{i}")).collect());
    w.cleanup().await;
}

matrix!(poison_goes_to_quarantine_with_its_headers_and_a_reason);
async fn poison_goes_to_quarantine_with_its_headers_and_a_reason(t: Target) {
    let w = World::on("poison", &t).await;
    let mut jobs = vec![job("good", json!({"chapters": "[1,2]"}))];
    jobs.push(job("no-asset", json!({"chapters": "[]", "asset": null})));
    jobs.push(job("bad-chapters", json!({"chapters": "[1,"})));
    let mut text = job("text", json!({}));
    text.1 = b"not json at all".to_vec();
    jobs.push(text);
    w.dead_letter(jobs).await;
    let resource = w.manifest(&format!(
        "  poison: {{requiredFields: [/id, /chapters], jsonFields: [/chapters]}}\n{}",
        w.idempotency("Check")
    ));
    let status = w.run(&resource).await;
    let c = status.counts;
    assert_eq!((c.replayed, c.quarantined), (2, 2), "{c:?}");
    let q = by_id(&w.take(&w.topo.quarantine).await);
    assert!(header(&q["bad-chapters"], "x-quarantine-reason")
        .unwrap()
        .contains("/chapters"));
    assert!(header(&q["text"], "x-quarantine-reason")
        .unwrap()
        .starts_with("NotJson"));
    // Quarantine keeps the deaths, for the human who looks at it.
    assert!(q["text"].headers.contains_key("x-death"));
    assert_eq!(q["text"].body, b"not json at all");
    let audit = w.audit(&status).await;
    assert!(audit.iter().any(|r| r.message == "text"
        && r.decision == "quarantined"
        && r.reason.starts_with("NotJson")));
    w.cleanup().await;
}

matrix!(claim_mode_publishes_each_key_once_and_respects_other_claims);
async fn claim_mode_publishes_each_key_once_and_respects_other_claims(t: Target) {
    let w = World::on("claim", &t).await;
    let mut jobs = Vec::new();
    for i in 0..10 {
        jobs.push(job(&format!("k{i}"), json!({})));
    }
    // The same work twice (same /id), with different message ids.
    let (p, b) = job("k3", json!({"again": true}));
    jobs.push((p.with_message_id("k3-copy".into()), b));
    jobs.push(job("claimed-elsewhere", json!({})));
    jobs.push(job("finished", json!({})));
    w.dead_letter(jobs).await;
    w.set(&w.key("claimed-elsewhere"), "other-replay/1").await;
    w.set(&w.key("finished"), "done").await;
    let status = w.run(&w.manifest(&w.idempotency("Claim"))).await;
    let c = status.counts;
    assert_eq!((c.replayed, c.duplicates, c.failed), (10, 3, 0), "{c:?}");
    let target = w.take(&w.topo.work).await;
    assert_each_key_once(&target);
    assert_eq!(
        dlq_replay::metrics::Metrics::global()
            .double_published
            .get(),
        0
    );
    let claim = w.get(&w.key("k0")).await.unwrap();
    assert!(
        claim.starts_with(status.replay_id.as_deref().unwrap()),
        "{claim}"
    );
    assert_eq!(
        w.get(&w.key("claimed-elsewhere")).await.as_deref(),
        Some("other-replay/1")
    );
    w.cleanup().await;
}

matrix!(a_finished_replay_run_again_reports_its_result_and_replays_nothing);
async fn a_finished_replay_run_again_reports_its_result_and_replays_nothing(t: Target) {
    let w = World::on("rerun", &t).await;
    w.dead_letter((0..5).map(|i| job(&format!("m{i}"), json!({}))).collect())
        .await;
    let resource = w.manifest(&w.idempotency("Check"));
    let first = w.run(&resource).await;
    assert_eq!(first.counts.replayed, 5);
    assert_eq!(w.take(&w.topo.work).await.len(), 5);
    // New dead letters arrive; the finished replay must not touch them.
    w.dead_letter(vec![job("late", json!({}))]).await;
    let second = w.run(&resource).await;
    assert_eq!(second, first);
    assert_eq!(w.depth(&w.topo.dlq).await, 1);
    assert_eq!(w.depth(&w.topo.work).await, 0);
    w.cleanup().await;
}
