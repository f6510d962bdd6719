//! Crash and resume: a real `kill -9` of `dlq-replay run` at several points, then the rerun.

mod support;

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use dlq_replay::api::Phase;
use serde_json::json;
use support::*;

const N: usize = 600;
const KILLS_MS: [u64; 3] = [400, 700, 1100];

async fn run_cli(
    file: &std::path::Path,
    kill_after: Option<Duration>,
) -> Option<std::process::Output> {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"));
    cmd.args(["run", "--no-progress", "-o", "json", "-f"])
        .arg(file)
        .env("REDIS_URL", REDIS)
        .env_remove("AMQP_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn dlq-replay");
    match kill_after {
        Some(after) => {
            tokio::time::sleep(after).await;
            child.start_kill().expect("kill -9");
            let _ = child.wait().await;
            None
        }
        None => Some(child.wait_with_output().await.expect("dlq-replay output")),
    }
}

/// Kill the replay at each point, rerun it to the end, and return where every message went.
async fn crash_and_resume(w: &World, mode: &str) -> (dlq_replay::api::DlqReplayStatus, Places) {
    w.dead_letter(
        (0..N)
            .map(|i| job(&format!("c{i:04}"), json!({})))
            .collect(),
    )
    .await;
    let resource = w.manifest(&format!(
        "  rate: {{messagesPerSecond: 400, burst: 20}}\n{}",
        w.idempotency(mode)
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replay.yaml");
    std::fs::write(&file, serde_yaml::to_string(&resource).unwrap()).unwrap();
    for ms in KILLS_MS {
        run_cli(&file, Some(Duration::from_millis(ms))).await;
    }
    let out = run_cli(&file, None).await.unwrap();
    assert!(
        out.status.success(),
        "final run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let status: dlq_replay::api::DlqReplayStatus =
        serde_json::from_value(printed["status"].clone()).unwrap();
    assert_eq!(status.phase, Some(Phase::Done));
    let mut places = Places::default();
    for m in w.take(&w.topo.work).await {
        places.target.entry(m.id).or_default().push(());
    }
    for m in w.take(&w.topo.quarantine).await {
        places.quarantine.insert(
            m.id.clone(),
            header(&m, "x-quarantine-reason").unwrap_or_default(),
        );
    }
    places.dlq = ids(&w.peek(&w.topo.dlq).await);
    let audit = w.audit(&status).await;
    assert_eq!(
        audit.len() as u64,
        status.counts.scanned - status.counts.skipped,
        "audit rows vs counts"
    );
    assert_eq!(status.audit.as_ref().unwrap().records, audit.len() as u64);
    places.duplicates = audit
        .iter()
        .filter(|r| r.decision == "duplicate")
        .map(|r| r.message.clone())
        .collect();
    assert_sum(&status);
    (status, places)
}

#[derive(Default, Debug)]
struct Places {
    target: BTreeMap<String, Vec<()>>,
    quarantine: BTreeMap<String, String>,
    dlq: Vec<String>,
    duplicates: Vec<String>,
}

impl Places {
    fn lost(&self) -> Vec<String> {
        (0..N)
            .map(|i| format!("c{i:04}"))
            .filter(|id| {
                !self.target.contains_key(id)
                    && !self.quarantine.contains_key(id)
                    && !self.dlq.contains(id)
                    && !self.duplicates.contains(id)
            })
            .collect()
    }
}

#[tokio::test]
async fn claim_mode_survives_kill_9_without_publishing_a_key_twice() {
    let w = World::new("kill-claim").await;
    let (status, places) = crash_and_resume(&w, "Claim").await;
    assert_eq!(places.lost(), Vec::<String>::new(), "messages lost");
    let twice: Vec<_> = places
        .target
        .iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|(k, _)| k)
        .collect();
    assert!(twice.is_empty(), "published twice in Claim mode: {twice:?}");
    // What a crash left unknown is quarantined, never republished; at most a window per kill.
    assert!(
        places
            .quarantine
            .values()
            .all(|r| r.starts_with("OutcomeUnknown")),
        "{:?}",
        places.quarantine
    );
    let window = 400 / 10;
    assert!(
        places.quarantine.len() <= window * KILLS_MS.len(),
        "{} unknown",
        places.quarantine.len()
    );
    assert!(places.dlq.is_empty(), "{:?}", places.dlq);
    // The target also holds the unknown ones whose publish did go out before the kill.
    let replayed = status.counts.replayed as usize;
    assert!(
        places.target.len() >= replayed
            && places.target.len() - replayed <= places.quarantine.len()
    );
    eprintln!(
        "claim: {} replayed, {} OutcomeUnknown over {} kills",
        replayed,
        places.quarantine.len(),
        KILLS_MS.len()
    );
    w.cleanup().await;
}

#[tokio::test]
async fn check_mode_survives_kill_9_and_duplicates_at_most_the_unknown_window() {
    let w = World::new("kill-check").await;
    let (_status, places) = crash_and_resume(&w, "Check").await;
    assert_eq!(places.lost(), Vec::<String>::new(), "messages lost");
    let twice = places.target.values().filter(|v| v.len() > 1).count();
    let window = 400 / 10;
    assert!(twice <= window * KILLS_MS.len(), "{twice} published twice");
    eprintln!(
        "check: {twice} published twice over {} kills",
        KILLS_MS.len()
    );
    assert!(places.quarantine.is_empty() && places.dlq.is_empty());
    // Every message reached the target (at least once): Check mode is at-least-once.
    assert_eq!(places.target.len(), N);
    w.cleanup().await;
}
