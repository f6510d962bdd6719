//! A replay's life under the operator: applied and run to Done, waiting for a Secret, an
//! evicting Redis or a busy source, suspended and resumed, deleted mid-drain, the operator
//! restarted mid-drain.

use super::*;

pub(crate) async fn apply_runs_the_replay_to_done_with_correct_counts_and_events(c: &Cluster) {
    let w = World::new("ctl-done").await;
    let mut jobs: Vec<_> = (0..30).map(|i| job(&format!("j{i}"), json!({}))).collect();
    let mut bad = job("bad", json!({}));
    bad.1 = b"nope".to_vec();
    jobs.push(bad);
    w.dead_letter(jobs).await;
    w.set(&w.key("j0"), "done").await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let extra = format!(
        "  poison: {{requiredFields: [/id]}}\n{}  rate: {{messagesPerSecond: 20}}\n",
        w.idempotency("Check")
    );
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "done", &extra),
    )
    .await
    .unwrap();
    let r = wait_for(&api, "done", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = r.status.clone().unwrap();
    assert_eq!(
        (s.counts.replayed, s.counts.duplicates, s.counts.quarantined),
        (29, 1, 1),
        "{s:?}"
    );
    assert_eq!(s.observed_generation, Some(1));
    assert!(s
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True"));
    // kstatus: Current (`kubectl wait --for=condition=Ready` returns).
    assert_eq!(condition(&r, "Reconciling").as_deref(), Some("False"));
    assert_eq!(condition(&r, "Stalled").as_deref(), Some("False"));
    assert!(r.finalizers().iter().any(|f| f == controller::FINALIZER));
    // Conditions as metav1.Condition, each with the generation it was computed for; the status
    // is server-side applied by the operator's field manager (a real server records it).
    let raw = c.get_json("dlqreplays", c.ns(), "done").await.unwrap();
    let conditions = raw["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        !conditions.is_empty() && conditions.iter().all(|c| c["observedGeneration"] == 1),
        "{raw}"
    );
    if c.is_real() {
        let applied = raw["metadata"]["managedFields"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .any(|m| {
                m["manager"] == controller::MANAGER
                    && m["operation"] == "Apply"
                    && m["subresource"] == "status"
            });
        assert!(applied, "status not server-side applied: {raw}");
    }
    // 29 replays at 20/s is about 1.5 s: throttled to a write per 0.5 s, not one per message.
    // (A real cluster does not count status writes: checked on the fake only.)
    if let Some(writes) = c.status_writes(c.ns(), "done") {
        assert!(writes < 15, "{writes} status writes");
    }
    let events = events_once(c, |e| {
        let r = reasons(e);
        r.iter().any(|r| r == "Draining") && r.iter().any(|r| r == "Done")
    })
    .await;
    let reasons = reasons(&events);
    assert!(
        reasons.contains(&"Draining".to_string()) && reasons.contains(&"Done".to_string()),
        "{reasons:?}"
    );
    eprintln!(
        "$ kubectl get dlqreplays -n {}\n{}",
        c.ns(),
        kubectl_get(&[r])
    );
    assert_eq!(w.take(&w.topo.work).await.len(), 29);
    // Re-applying the same manifest starts nothing new: a Done replay stays done.
    let patch = json!({"metadata": {"labels": {"touched": "yes"}}});
    api.patch("done", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(phase(&api.get("done").await.unwrap()), Some(Phase::Done));
    assert_eq!(w.depth(&w.topo.work).await, 0);
    w.cleanup().await;
}

pub(crate) async fn a_missing_secret_keeps_it_pending_until_the_secret_exists(c: &Cluster) {
    let w = World::new("ctl-secret").await;
    w.dead_letter((0..5).map(|i| job(&format!("s{i}"), json!({}))).collect())
        .await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(&PostParams::default(), &resource(&w, c.ns(), "sec", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "sec", "Pending", |r| phase(r) == Some(Phase::Pending)).await;
    let msg = r.status.unwrap().replay.message.unwrap();
    assert!(
        msg.contains("SecretMissing") && msg.contains("rabbitmq"),
        "{msg}"
    );
    assert_eq!(w.depth(&w.topo.dlq).await, 5);
    secrets(c).await;
    let r = wait_for(&api, "sec", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 5);
    // No password in status or events.
    let dump = format!(
        "{:?}{:?}",
        api.get("sec").await.unwrap().status,
        c.events(c.ns()).await
    );
    assert!(!dump.contains("guest:guest"), "a URL password leaked");
    w.cleanup().await;
}

pub(crate) async fn an_evicting_redis_keeps_it_pending_until_its_policy_changes(c: &Cluster) {
    let w = World::new("ctl-evict").await;
    w.dead_letter((0..5).map(|i| job(&format!("v{i}"), json!({}))).collect())
        .await;
    let redis = dlq_replay_testkit::faults::OwnRedis::start_with(&[
        "--maxmemory",
        "64mb",
        "--maxmemory-policy",
        "allkeys-lru",
    ]);
    c.put_secret(c.ns(), "rabbitmq", &[("url", AMQP)]).await;
    c.put_secret(c.ns(), "redis", &[("url", &redis.url())])
        .await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(&PostParams::default(), &resource(&w, c.ns(), "evict", ""))
        .await
        .unwrap();
    let said = |r: &DlqReplay| {
        r.status
            .as_ref()
            .and_then(|s| s.message.clone())
            .unwrap_or_default()
    };
    let r = wait_for(&api, "evict", "Pending on the eviction policy", |r| {
        phase(r) == Some(Phase::Pending) && said(r).contains("allkeys-lru")
    })
    .await;
    assert!(
        said(&r).contains("spec.audit.acceptRedisEviction"),
        "{}",
        said(&r)
    );
    assert_eq!(w.depth(&w.topo.dlq).await, 5, "nothing moved");
    // The Redis's owner changes the policy: the replay goes on by itself.
    let mut admin = dlq_replay::engine::store::connect(&redis.url())
        .await
        .unwrap();
    redis::cmd("CONFIG")
        .arg(["SET", "maxmemory-policy", "noeviction"].as_slice())
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let r = wait_for(&api, "evict", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = r.status.unwrap();
    assert_eq!((s.counts.replayed, s.replay.redis_eviction_risk), (5, None));
    w.cleanup().await;
}

pub(crate) async fn a_second_replay_of_the_same_queue_waits_source_busy(c: &Cluster) {
    let w = World::new("ctl-busy").await;
    w.dead_letter((0..40).map(|i| job(&format!("b{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "first", "  rate: {messagesPerSecond: 20}\n"),
    )
    .await
    .unwrap();
    wait_for(&api, "first", "Draining", |r| {
        phase(r) == Some(Phase::Draining)
    })
    .await;
    api.create(&PostParams::default(), &resource(&w, c.ns(), "second", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "second", "SourceBusy", |r| {
        r.status
            .as_ref()
            .and_then(|s| s.message.clone())
            .is_some_and(|m| m.contains("SourceBusy"))
    })
    .await;
    assert_eq!(phase(&r), Some(Phase::Pending));
    wait_for(&api, "first", "Done", |r| phase(r) == Some(Phase::Done)).await;
    // Once the first is done the second runs, and finds nothing left.
    let r = wait_for(&api, "second", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.scanned, 0);
    assert_eq!(w.take(&w.topo.work).await.len(), 40);
    w.cleanup().await;
}

/// Set `spec.suspend` of replay `name`.
pub(crate) async fn suspend(api: &Api<DlqReplay>, name: &str, on: bool) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": on}})),
    )
    .await
    .unwrap();
}

pub(crate) async fn suspend_pauses_after_in_flight_settles_and_resume_finishes(c: &Cluster) {
    let w = World::new("ctl-suspend").await;
    w.dead_letter((0..60).map(|i| job(&format!("p{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "sus", "  rate: {messagesPerSecond: 20}\n"),
    )
    .await
    .unwrap();
    wait_for(&api, "sus", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    suspend(&api, "sus", true).await;
    // Suspended, and the status is of the new generation (kstatus and Argo CD wait for that),
    // with none of Ready, Reconciling and Stalled True.
    let r = wait_for(&api, "sus", "Suspended of generation 2", |r| {
        phase(r) == Some(Phase::Suspended)
            && r.status.as_ref().and_then(|s| s.observed_generation) == r.metadata.generation
    })
    .await;
    for type_ in ["Ready", "Reconciling", "Stalled"] {
        assert_eq!(condition(&r, type_).as_deref(), Some("False"), "{type_}");
    }
    let at_pause = r.status.unwrap().counts.replayed;
    assert!(at_pause < 60, "suspended too late");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        w.depth(&w.topo.work).await as u64,
        at_pause,
        "published while suspended"
    );
    assert_eq!(
        w.depth(&w.topo.dlq).await as u64,
        60 - at_pause,
        "a message was half done"
    );
    suspend(&api, "sus", false).await;
    let r = wait_for(&api, "sus", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 60);
    // Suspending the ended replay changes nothing but is observed: its status is of the new
    // generation (else kstatus reads it as in progress for ever), still Done and Ready.
    suspend(&api, "sus", true).await;
    let r = wait_for(&api, "sus", "Done of generation 4", |r| {
        r.metadata.generation == Some(4)
            && r.status.as_ref().and_then(|s| s.observed_generation) == Some(4)
    })
    .await;
    assert_eq!(phase(&r), Some(Phase::Done));
    assert_eq!(condition(&r, "Ready").as_deref(), Some("True"));
    assert_eq!(r.status.unwrap().counts.replayed, 60);
    assert_eq!(w.take(&w.topo.work).await.len(), 60);
    w.cleanup().await;
}

pub(crate) async fn deleting_mid_drain_stops_cleanly_and_loses_nothing(c: &Cluster) {
    let w = World::new("ctl-delete").await;
    w.dead_letter((0..60).map(|i| job(&format!("d{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "del", "  rate: {messagesPerSecond: 20}\n"),
    )
    .await
    .unwrap();
    wait_for(&api, "del", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    api.delete("del", &DeleteParams::default()).await.unwrap();
    let t = Instant::now();
    while api.get_opt("del").await.unwrap().is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the finalizer never let go"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let target = w.depth(&w.topo.work).await;
    let left = w.depth(&w.topo.dlq).await;
    assert!(target < 60, "the replay was not stopped");
    assert_eq!(target + left, 60, "target {target} + dlq {left}");
    // Created again under the same name, it is a new replay (new uid): it drains the rest.
    api.create(&PostParams::default(), &resource(&w, c.ns(), "del", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "del", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, u64::from(left));
    assert_eq!(w.depth(&w.topo.work).await, 60);
    // A finished replay deleted and created again is not "already done": it replays anew.
    api.delete("del", &DeleteParams::default()).await.unwrap();
    while api.get_opt("del").await.unwrap().is_some() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(w.take(&w.topo.work).await.len(), 60);
    w.dead_letter(vec![job("late-1", json!({})), job("late-2", json!({}))])
        .await;
    api.create(&PostParams::default(), &resource(&w, c.ns(), "del", ""))
        .await
        .unwrap();
    let r = wait_for(&api, "del", "Done again", |r| {
        phase(r) == Some(Phase::Done) && r.status.as_ref().is_some_and(|s| s.counts.replayed == 2)
    })
    .await;
    assert_eq!(r.status.unwrap().counts.scanned, 2);
    let ids: Vec<String> = w
        .take(&w.topo.work)
        .await
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(ids, ["late-1", "late-2"]);
    w.cleanup().await;
}

pub(crate) async fn an_operator_restart_mid_drain_resumes_and_loses_nothing(c: &Cluster) {
    let w = World::new("ctl-restart").await;
    w.dead_letter((0..60).map(|i| job(&format!("r{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (op, stop) = operator(c);
    let api = replays(c);
    let extra = format!(
        "{}  rate: {{messagesPerSecond: 20}}\n",
        w.idempotency("Claim")
    );
    api.create(&PostParams::default(), &resource(&w, c.ns(), "rst", &extra))
        .await
        .unwrap();
    let before = wait_for(&api, "rst", "some progress", |r| {
        r.status.as_ref().is_some_and(|s| s.counts.replayed >= 5)
    })
    .await;
    let id = before.status.unwrap().replay.replay_id;
    stop.send(()).unwrap();
    op.await.unwrap().unwrap();
    // The operator's own stop is not the user's suspend: the replay waits for the next leader.
    let stopped = api.get("rst").await.unwrap().status.unwrap();
    assert_eq!(stopped.phase, Some(Phase::Pending), "{stopped:?}");
    let why = stopped.replay.message.unwrap_or_default();
    assert!(why.starts_with("OperatorStopped:"), "{why}");
    let (_op2, _stop2) = operator(c);
    let r = wait_for(&api, "rst", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = r.status.unwrap();
    assert_eq!(s.replay_id, id, "a restart must resume the same replay");
    let target = w.take(&w.topo.work).await;
    assert_each_key_once(&target);
    assert_eq!(
        target.len() as u64 + w.depth(&w.topo.quarantine).await as u64,
        60,
        "{s:?}"
    );
    w.cleanup().await;
}
