//! A replay's Redis keys after `dlq-replay run`: kept for `spec.audit.retentionSeconds` after
//! the run (its settled marks removed at Done), none written by a dry run, and `--retry`
//! reopening a `CanaryFailed` replay in place.
//! The binary runs against the local RabbitMQ and Redis. (The operator's side, the
//! `replay.dlq.dev/retry` annotation, is in `tests/controller.rs`.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use dlq_replay::api::{CanaryResult, DlqReplay, Phase};
use dlq_replay_testkit::world::*;
use serde_json::json;

/// `dlq-replay run -f MANIFEST --redis-url <the tests' Redis> --no-progress ARGS`: exit code, the printed
/// resource (when one was printed) and stderr. Awaited, so that the test's worker keeps working
/// meanwhile.
async fn run(resource: &DlqReplay, args: &[&str]) -> (i32, Option<DlqReplay>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("replay.yaml");
    std::fs::write(&path, serde_yaml::to_string(resource).unwrap()).unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"))
        .args(["run", "-f", path.to_str().unwrap(), "--no-progress"])
        .args(["--redis-url", redis_url()])
        .args(args)
        .output()
        .await
        .unwrap();
    let printed = serde_yaml::from_slice(&out.stdout).ok();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code().unwrap_or(-1), printed, stderr)
}

fn ttl_of(w: &World, key: &str) -> impl std::future::Future<Output = i64> {
    let mut con = w.redis.clone();
    let key = key.to_string();
    async move {
        redis::cmd("TTL")
            .arg(key)
            .query_async(&mut con)
            .await
            .unwrap()
    }
}

#[tokio::test]
async fn a_run_keeps_its_keys_for_the_retention_and_a_dry_run_writes_none() {
    let w = World::new("retain").await;
    w.dead_letter((0..10).map(|i| job(&format!("k{i}"), json!({}))).collect())
        .await;
    let extra = format!(
        "{}  audit: {{retentionSeconds: 3600}}\n",
        w.idempotency("Claim")
    );
    let (code, printed, stderr) = run(&w.manifest(&extra), &[]).await;
    assert_eq!(code, 0, "{stderr}");
    let s = printed.and_then(|r| r.status).expect("the final resource");
    assert_eq!((s.phase, s.counts.replayed), (Some(Phase::Done), 10));
    let id = s.replay.replay_id.unwrap();
    let audit = s.replay.audit.unwrap().key;
    let keys = [
        format!("dlq:replay:tests/{}", w.tag),
        format!("{audit}#dict"),
        audit,
    ];
    for key in &keys {
        let ttl = ttl_of(&w, key).await;
        assert!((3500..=3600).contains(&ttl), "{key}: TTL {ttl}");
    }
    // The settled marks serve a resume only: a Done replay has none left.
    let settled = format!("dlq:settled:tests/{}/{id}", w.tag);
    assert_eq!(ttl_of(&w, &settled).await, -2, "{settled} outlived Done");
    w.cleanup().await;

    // A dry run (`plan`) writes nothing, so nothing to expire either.
    let w = World::new("retain-dry").await;
    w.dead_letter((0..3).map(|i| job(&format!("d{i}"), json!({}))).collect())
        .await;
    let extra = format!("{}  dryRun: true\n", w.idempotency("Claim"));
    let (code, _, stderr) = run(&w.manifest(&extra), &[]).await;
    assert_eq!(code, 0, "{stderr}");
    let state = format!("dlq:replay:tests/{}", w.tag);
    assert_eq!(
        ttl_of(&w, &state).await,
        -2,
        "{state} exists after a dry run"
    );
    w.cleanup().await;
}

#[tokio::test]
async fn retry_reopens_a_canary_failed_replay_in_place() {
    let w = World::new("retry-cli").await;
    w.dead_letter((0..6).map(|i| job(&format!("c{i}"), json!({}))).collect())
        .await;
    let broken = Arc::new(AtomicBool::new(true));
    let still_broken = broken.clone();
    let _worker = w.worker(move |_| still_broken.load(Ordering::SeqCst)).await;
    let mut r = w.manifest("");
    r.spec.canary.enabled = true;
    r.spec.canary.wait_seconds = 5;

    let (code, printed, stderr) = run(&r, &[]).await;
    let first = printed.and_then(|r| r.status).expect("the final resource");
    assert_eq!(
        (code, first.phase),
        (1, Some(Phase::CanaryFailed)),
        "{stderr}{first:?}"
    );
    assert_eq!(first.canary[0].result, CanaryResult::DiedAgain);

    // Run again as it is: the stored end is reported, nothing is sent.
    let (code, printed, stderr) = run(&r, &[]).await;
    let again = printed.and_then(|r| r.status).expect("the final resource");
    assert_eq!(
        (code, again.phase),
        (1, Some(Phase::CanaryFailed)),
        "{stderr}"
    );
    assert_eq!(again.counts, first.counts);

    // The fix is deployed: --retry sends a new canary, which passes, and the rest drains.
    broken.store(false, Ordering::SeqCst);
    let (code, printed, stderr) = run(&r, &["--retry"]).await;
    let done = printed.and_then(|r| r.status).expect("the final resource");
    assert_eq!(
        (code, done.phase),
        (0, Some(Phase::Done)),
        "{stderr}{done:?}"
    );
    assert!(stderr.contains("retrying it in place"), "{stderr}");
    assert_eq!(done.replay_id, first.replay_id, "the same replay id");
    assert_eq!(done.canary.len(), 1);
    assert_eq!(done.canary[0].result, CanaryResult::Passed);
    assert_eq!(done.counts.replayed, 6, "{done:?}");
    assert_sum(&done);
    // The canary that came back carries this replay's id: it stays in the DLQ.
    assert_eq!(w.depth(&w.topo.dlq).await, 1);

    // --retry does not reopen a Done replay: it reports its stored end again.
    let (code, printed, stderr) = run(&r, &["--retry"]).await;
    let still = printed.and_then(|r| r.status).expect("the final resource");
    assert_eq!((code, still.counts), (0, done.counts), "{stderr}");
    assert!(
        stderr.contains("ended Done and is not reopened"),
        "{stderr}"
    );
    w.cleanup().await;
}
