//! A replay's footprint in the workers' Redis: what a `Done` replay leaves (its compact audit
//! trail and its state, no settled marks), the audit sent to the log instead, and the pre-flight
//! that refuses a Redis whose eviction could take the workers' done marks. Against the real
//! RabbitMQ and Redis, and Redis servers of the tests' own for the eviction policies.

use dlq_replay::api::{AuditSink, DlqReplay, Phase};
use dlq_replay::engine::{self, store};
use dlq_replay_testkit::faults::OwnRedis;
use dlq_replay_testkit::world::*;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Every Redis key of a world's replay (state, audit, dictionary, settled marks), sorted.
async fn replay_keys(w: &World) -> Vec<String> {
    let mut r = w.redis.clone();
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("dlq:*tests/{}*", w.tag))
        .query_async(&mut r)
        .await
        .unwrap();
    keys.sort();
    keys
}

matrix!(a_done_replay_leaves_its_audit_trail_and_state_only);
async fn a_done_replay_leaves_its_audit_trail_and_state_only(t: Target) {
    let w = World::on("footprint", &t).await;
    let mut jobs: Vec<_> = (0..12)
        .map(|i| job(&format!("f{i}"), json!({"chapters": "[1]"})))
        .collect();
    jobs.push(job("bad", json!({"chapters": "[1,"})));
    w.dead_letter(jobs).await;
    w.set(&w.key("f0"), "done").await;
    let resource = w.manifest(&format!(
        "  poison: {{jsonFields: [/chapters]}}\n{}",
        w.idempotency("Check")
    ));
    let status = w.run(&resource).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert_eq!(
        (
            status.counts.replayed,
            status.counts.duplicates,
            status.counts.quarantined
        ),
        (11, 1, 1)
    );
    let id = status.replay_id.clone().unwrap();
    let audit = status.audit.clone().unwrap().key;
    assert_eq!(
        replay_keys(&w).await,
        vec![
            audit.clone(),
            format!("{audit}#dict"),
            format!("dlq:replay:tests/{}", w.tag)
        ],
        "the settled marks outlived Done"
    );

    // The compact rows read back whole: the replay id from the key, the time from the entry
    // id, the key with its prefix, destination and signature from the dictionary.
    let rows = w.audit(&status).await;
    assert_eq!(rows.len() as u64, status.audit.unwrap().records);
    assert_eq!(rows.len(), 13);
    let dest = format!("{}/{}", w.topo.exchange, dlq_replay::fixture::ROUTING_KEY);
    for row in &rows {
        assert_eq!(row.replay, id);
        assert!(
            chrono::DateTime::parse_from_rfc3339(&row.time).is_ok(),
            "{row:?}"
        );
        assert!(!row.canary);
        match row.decision.as_str() {
            "replayed" => {
                assert_eq!(row.key, w.key(&row.message), "{row:?}");
                assert_eq!(row.destination, dest, "{row:?}");
                assert_eq!(row.reason, "");
            }
            "duplicate" => assert_eq!((row.message.as_str(), row.key.clone()), ("f0", w.key("f0"))),
            "quarantined" => {
                assert_eq!(row.message, "bad");
                assert_eq!(row.destination, w.topo.quarantine);
                assert!(row.reason.contains("/chapters"), "{row:?}");
            }
            other => panic!("unexpected decision {other}: {row:?}"),
        }
    }
    w.cleanup().await;
}

/// `dlq-replay ARGS` against the world's broker (`AMQP_URL`, which `make test` sets for the
/// local RabbitMQ 3.10, would override the manifest's); exit code, stdout, stderr.
async fn binary(w: &World, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"))
        .args(args)
        .env("AMQP_URL", w.amqp_url())
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write_manifest(dir: &tempfile::TempDir, resource: &DlqReplay) -> String {
    let path = dir.path().join("replay.yaml");
    std::fs::write(&path, serde_yaml::to_string(resource).unwrap()).unwrap();
    path.to_str().unwrap().to_string()
}

// The log sink does not touch the broker differently from the Redis one: one broker and queue
// type of each generation.
matrix!(an_audit_sent_to_the_log_is_read_back_from_it: classic_3_10, quorum_4_x);
async fn an_audit_sent_to_the_log_is_read_back_from_it(t: Target) {
    let w = World::on("auditlog", &t).await;
    w.dead_letter((0..8).map(|i| job(&format!("l{i}"), json!({}))).collect())
        .await;
    w.set(&w.key("l3"), "done").await;
    let resource = w.manifest(&format!(
        "{}  audit: {{sink: Log}}\n",
        w.idempotency("Claim")
    ));
    let dir = tempfile::tempdir().unwrap();
    let path = write_manifest(&dir, &resource);
    let (code, out, err) = binary(
        &w,
        &[
            "run",
            "-f",
            &path,
            "--no-progress",
            "--redis-url",
            redis_url(),
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let status = serde_yaml::from_str::<DlqReplay>(&out)
        .unwrap()
        .status
        .unwrap();
    assert_eq!((status.counts.replayed, status.counts.duplicates), (7, 1));
    let audit = status.audit.clone().unwrap();
    assert_eq!((audit.sink, audit.records), (AuditSink::Log, 8));
    let rows = store::rows_of_log(&err, status.replay_id.as_deref());
    assert_eq!(rows.len(), 8, "{err}");
    assert!(rows
        .iter()
        .all(|r| r.key == w.key(&r.message) && !r.time.is_empty()));
    // Redis holds the state only: no stream, no dictionary, no settled marks.
    assert_eq!(
        replay_keys(&w).await,
        vec![format!("dlq:replay:tests/{}", w.tag)]
    );
    // `audit --log` reads the same rows back from the log.
    let log = dir.path().join("operator.log");
    std::fs::write(&log, &err).unwrap();
    let (code, jsonl, e) = binary(
        &w,
        &[
            "audit",
            "-f",
            &path,
            "--redis-url",
            redis_url(),
            "--log",
            log.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(code, 0, "{e}");
    let back: Vec<store::AuditRow> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(back, rows);
    w.cleanup().await;
}

async fn dbsize(url: &str) -> u64 {
    let mut con = store::connect(url).await.unwrap();
    redis::cmd("DBSIZE").query_async(&mut con).await.unwrap()
}

matrix!(an_evicting_redis_is_refused_unless_the_risk_is_accepted);
async fn an_evicting_redis_is_refused_unless_the_risk_is_accepted(t: Target) {
    let redis = OwnRedis::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]);
    let url = redis.url();
    let w = World::on("evict", &t).await;
    let jobs: Vec<_> = (0..6).map(|i| job(&format!("e{i}"), json!({}))).collect();
    w.dead_letter(jobs).await;
    let before = w.peek(&w.topo.dlq).await;
    let resource = w.manifest(&w.idempotency("Claim"));
    let (tx, _rx) = tokio::sync::watch::channel(Default::default());
    let opts = engine::Options::default();
    let err = engine::run(
        &w.replay_on(&resource, &url),
        &opts,
        &tx,
        &CancellationToken::new(),
    )
    .await
    .expect_err("an allkeys-lru Redis must be refused");
    let why = err.to_string();
    assert!(
        why.contains("allkeys-lru") && why.contains("spec.audit.acceptRedisEviction"),
        "{why}"
    );
    assert_eq!(dbsize(&url).await, 0, "nothing was written");
    assert_eq!(w.peek(&w.topo.dlq).await, before, "nothing moved");
    // `plan` tells the reviewer so before the manifest is applied.
    let dir = tempfile::tempdir().unwrap();
    let path = write_manifest(&dir, &resource);
    let (code, out, err) = binary(&w, &["plan", "-f", &path, "--redis-url", &url]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("maxmemory-policy allkeys-lru") && out.contains("run would refuse to start"),
        "{out}"
    );

    // Accepted: it runs, and status and the report say what was accepted.
    let mut accepted = w.manifest(&format!(
        "{}  audit: {{acceptRedisEviction: true}}\n",
        w.idempotency("Claim")
    ));
    let status = run_replay(&w.replay_on(&accepted, &url)).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    assert_eq!(status.counts.replayed, 6);
    let risk = status.redis_eviction_risk.clone().unwrap_or_default();
    assert!(
        risk.starts_with("accepted") && risk.contains("allkeys-lru"),
        "{risk}"
    );
    accepted.status = None;
    let path = write_manifest(&dir, &accepted);
    let (code, page, err) = binary(
        &w,
        &["report", "-f", &path, "--redis-url", &url, "--format", "md"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(page.contains("Redis eviction risk:** accepted"), "{page}");
    w.cleanup().await;
}

#[tokio::test]
async fn the_pre_flight_reads_a_redis_that_refuses_config() {
    // A managed Redis's user: INFO allowed, CONFIG refused. The policy is read from INFO.
    let redis = OwnRedis::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lfu"]);
    let mut admin = store::connect(&redis.url()).await.unwrap();
    redis::cmd("ACL")
        .arg(["SETUSER", "app", "on", ">pw", "~*", "+@all", "-config"].as_slice())
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let mut app = store::connect(&redis.url_as("app", "pw")).await.unwrap();
    let refused: Result<Vec<String>, _> = redis::cmd("CONFIG")
        .arg(["GET", "maxmemory-policy"].as_slice())
        .query_async(&mut app)
        .await;
    assert!(refused.is_err(), "the user must not be allowed CONFIG");
    let room = store::Room::read(&mut app).await.unwrap();
    assert_eq!(
        (room.policy.as_str(), room.maxmemory),
        ("allkeys-lfu", 64 * 1024 * 1024)
    );
    assert!(room.risk(0).unwrap().contains("allkeys-lfu"));

    // Neither INFO nor CONFIG: the pre-flight cannot tell, and says so.
    redis::cmd("ACL")
        .arg(
            [
                "SETUSER", "blind", "on", ">pw", "~*", "+@all", "-config", "-info",
            ]
            .as_slice(),
        )
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let mut blind = store::connect(&redis.url_as("blind", "pw")).await.unwrap();
    let why = store::Room::read(&mut blind).await.unwrap_err().to_string();
    assert!(why.contains("INFO memory"), "{why}");
}
