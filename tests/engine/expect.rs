//! `spec.expect`: what a reviewer approved is the most a replay does. Signatures not approved
//! stay in the dead-letter queue byte for byte and in order; a maximum reached stops the replay
//! before one more publish, the rest left in place; `plan` prints the stanza it would take.

use super::*;

/// What a stopped replay handed back, compared with what the DLQ held: in order, except on a
/// RabbitMQ 4 quorum queue, which puts what is handed back behind the rest (the messages are
/// the same, bytes and headers).
fn assert_left(t: &Target, mut left: Vec<Seen>, mut expected: Vec<Seen>) {
    if t.is_quorum() && !t.broker.is_v3_10() {
        left.sort_by(|a, b| a.id.cmp(&b.id));
        expected.sort_by(|a, b| a.id.cmp(&b.id));
    }
    assert_eq!(ids(&left), ids(&expected));
    assert_eq!(left, expected);
}

fn typed(id: &str, exception: &str) -> (BasicProperties, Vec<u8>) {
    dlq_replay::fixture::job(id, json!({ "id": id }), exception)
}

matrix!(only_approved_signatures_are_replayed_the_rest_stays_byte_for_byte);
async fn only_approved_signatures_are_replayed_the_rest_stays_byte_for_byte(t: Target) {
    let w = World::on("expect-sigs", &t).await;
    let mut jobs = Vec::new();
    for i in 0..9 {
        let kind = ["TimeoutError", "KeyError", "OOMKilled"][i % 3];
        jobs.push(typed(&format!("e{i}"), kind));
    }
    w.dead_letter(jobs).await;
    let before = w.peek(&w.topo.dlq).await;
    let status = w
        .run(&w.manifest(
            "  expect:\n    signatures: [x-exception-type=TimeoutError, x-exception-type=OOMKilled]\n",
        ))
        .await;
    assert_eq!(status.phase, Some(Phase::Done), "{:?}", status.message);
    let c = status.counts;
    assert_eq!((c.scanned, c.replayed, c.skipped), (9, 6, 3), "{c:?}");
    assert_sum(&status);
    assert_eq!(
        status.not_approved,
        BTreeMap::from([("x-exception-type=KeyError".to_string(), 3)])
    );
    let msg = status.message.unwrap_or_default();
    assert!(
        msg.contains("spec.expect.signatures") && msg.contains("KeyError"),
        "{msg}"
    );
    let approved: Vec<Seen> = before
        .iter()
        .filter(|m| header(m, "x-exception-type").as_deref() != Some("KeyError"))
        .cloned()
        .collect();
    let held: Vec<Seen> = before
        .iter()
        .filter(|m| header(m, "x-exception-type").as_deref() == Some("KeyError"))
        .cloned()
        .collect();
    assert_eq!(ids(&w.take(&w.topo.work).await), ids(&approved));
    // Held back: the same bytes, headers and order as before the replay.
    assert_eq!(w.peek(&w.topo.dlq).await, held);
    w.cleanup().await;
}

matrix!(reaching_max_replayed_stops_before_one_more_and_leaves_the_rest_in_place);
async fn reaching_max_replayed_stops_before_one_more_and_leaves_the_rest_in_place(t: Target) {
    let w = World::on("expect-max", &t).await;
    // Three already done (duplicates do not count against the maximum), then ten to replay.
    let jobs: Vec<_> = (0..13)
        .map(|i| job(&format!("m{i:02}"), json!({})))
        .collect();
    w.dead_letter(jobs).await;
    for id in ["m00", "m01", "m02"] {
        w.set(&w.key(id), "done").await;
    }
    let before = w.peek(&w.topo.dlq).await;
    let manifest = format!("{}  expect: {{maxReplayed: 6}}\n", w.idempotency("Claim"));
    let status = w.run(&w.manifest(&manifest)).await;
    assert_eq!(status.phase, Some(Phase::Failed), "{:?}", status.message);
    let msg = status.message.clone().unwrap_or_default();
    assert!(
        msg.starts_with("ExpectationReached: spec.expect.maxReplayed is 6"),
        "{msg}"
    );
    let c = status.counts;
    assert_eq!((c.replayed, c.duplicates), (6, 3), "{c:?}");
    assert_sum(&status);
    assert_eq!(ids(&w.take(&w.topo.work).await), ids(&before[3..9]));
    // The rest: never published, still in the DLQ with their bytes, in order.
    assert_left(&t, w.peek(&w.topo.dlq).await, before[9..].to_vec());
    // Run again: the maximum is reached already, nothing more goes out.
    let again = w.run(&w.manifest(&manifest)).await;
    assert_eq!(again.phase, Some(Phase::Failed), "{:?}", again.message);
    assert_eq!(again.counts.replayed, 6, "{:?}", again.counts);
    assert!(w.take(&w.topo.work).await.is_empty());
    assert_left(&t, w.peek(&w.topo.dlq).await, before[9..].to_vec());
    w.cleanup().await;
}

matrix!(reaching_max_quarantined_stops_the_replay: classic_3_10, quorum_4_x);
async fn reaching_max_quarantined_stops_the_replay(t: Target) {
    let w = World::on("expect-q", &t).await;
    let mut jobs: Vec<_> = (0..6).map(|i| job(&format!("q{i}"), json!({}))).collect();
    // Two without the required field: poison.
    jobs.insert(1, dlq_replay::fixture::job("p0", json!({}), "TimeoutError"));
    jobs.insert(3, dlq_replay::fixture::job("p1", json!({}), "TimeoutError"));
    w.dead_letter(jobs).await;
    let before = w.peek(&w.topo.dlq).await;
    let status = w
        .run(&w.manifest("  poison: {requiredFields: [/id]}\n  expect: {maxQuarantined: 1}\n"))
        .await;
    assert_eq!(status.phase, Some(Phase::Failed), "{:?}", status.message);
    let msg = status.message.clone().unwrap_or_default();
    assert!(msg.contains("spec.expect.maxQuarantined is 1"), "{msg}");
    assert_eq!(status.counts.quarantined, 1, "{:?}", status.counts);
    let quarantined = w.take(&w.topo.quarantine).await;
    assert_eq!(ids(&quarantined), vec!["p0".to_string()]);
    // The replay stopped at p1: it and everything after it are still in the DLQ.
    assert_eq!(
        ids(&w.take(&w.topo.work).await),
        vec!["q0".to_string(), "q1".to_string()]
    );
    assert_left(&t, w.peek(&w.topo.dlq).await, before[3..].to_vec());
    w.cleanup().await;
}

matrix!(the_stanza_plan_prints_approves_exactly_what_the_run_then_does);
async fn the_stanza_plan_prints_approves_exactly_what_the_run_then_does(t: Target) {
    let w = World::on("expect-plan", &t).await;
    let mut jobs: Vec<_> = (0..8)
        .map(|i| typed(&format!("s{i}"), ["TimeoutError", "KeyError"][i % 2]))
        .collect();
    jobs.push(dlq_replay::fixture::job("bad", json!({}), "KeyError"));
    w.dead_letter(jobs).await;
    w.set(&w.key("s0"), "done").await;
    let base = format!(
        "  poison: {{requiredFields: [/id]}}\n{}",
        w.idempotency("Check")
    );
    let report = dlq_replay::engine::plan::plan(&w.replay(&w.manifest(&base)))
        .await
        .unwrap();
    let expect = report.expect.clone().expect("a stanza");
    assert_eq!(
        expect.signatures,
        vec![
            "x-exception-type=KeyError".to_string(),
            "x-exception-type=TimeoutError".to_string()
        ]
    );
    assert_eq!(
        (expect.max_replayed, expect.max_quarantined),
        (Some(7), Some(1))
    );
    assert_eq!(report.exceeds, None);
    // The stanza, pasted under spec: as the reviewer would, is what the run then does.
    let stanza = serde_yaml::to_string(&serde_json::json!({ "expect": expect })).unwrap();
    let pasted: String = stanza.lines().map(|l| format!("  {l}\n")).collect();
    let resource = w.manifest(&format!("{base}{pasted}"));
    // A plan under the stanza sees nothing past it.
    let again = dlq_replay::engine::plan::plan(&w.replay(&resource))
        .await
        .unwrap();
    assert_eq!((again.counts, again.exceeds.clone()), (report.counts, None));
    let status = w.run(&resource).await;
    assert_eq!(status.phase, Some(Phase::Done), "{:?}", status.message);
    assert_eq!(status.counts, report.counts);
    assert!(status.not_approved.is_empty());
    w.cleanup().await;
}

/// `dlq-replay run` of a manifest with `requireApproval`: nothing moves without `--approve`, nor
/// with a digest the queue no longer gives; the digest `plan` printed runs it.
#[tokio::test]
async fn run_requires_the_current_plan_digest_with_require_approval() {
    let w = World::new("expect-cli").await;
    w.dead_letter((0..5).map(|i| job(&format!("c{i}"), json!({}))).collect())
        .await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replay.yaml");
    let resource = w.manifest("  requireApproval: true\n");
    std::fs::write(&file, serde_yaml::to_string(&resource).unwrap()).unwrap();
    let cli = |args: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"));
        cmd.args(args)
            .arg("-f")
            .arg(&file)
            .env("REDIS_URL", redis_url())
            .env_remove("AMQP_URL");
        cmd.output().unwrap()
    };
    let plan = cli(&["plan"]);
    let text = String::from_utf8_lossy(&plan.stdout).to_string();
    let digest = text
        .lines()
        .find_map(|l| l.strip_prefix("plan digest: "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no digest in {text}"))
        .to_string();
    let refused = cli(&["run", "--no-progress"]);
    assert_eq!(refused.status.code(), Some(1));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("spec.requireApproval") && err.contains(&digest),
        "{err}"
    );
    assert_eq!(w.depth(&w.topo.dlq).await, 5, "nothing moved");
    // One more dead letter: the digest plan printed is stale.
    w.dead_letter(vec![job("late", json!({}))]).await;
    let stale = cli(&["run", "--no-progress", "--approve", &digest]);
    assert_eq!(stale.status.code(), Some(1));
    let err = String::from_utf8_lossy(&stale.stderr);
    assert!(err.contains("is not the current plan"), "{err}");
    assert_eq!(w.depth(&w.topo.dlq).await, 6, "nothing moved");
    let text = String::from_utf8_lossy(&cli(&["plan"]).stdout).to_string();
    let current = text
        .lines()
        .find_map(|l| l.strip_prefix("plan digest: "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_string();
    assert_ne!(current, digest);
    let ran = cli(&["run", "--no-progress", "-o", "json", "--approve", &current]);
    assert_eq!(
        ran.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    let out: serde_json::Value = serde_json::from_slice(&ran.stdout).unwrap();
    assert_eq!(out["status"]["phase"], "Done", "{out}");
    assert_eq!(out["status"]["counts"]["replayed"], 6, "{out}");
    w.cleanup().await;
}
