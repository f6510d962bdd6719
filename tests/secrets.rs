//! No URL password anywhere: each test creates a RabbitMQ user and a Redis ACL user with unique
//! passwords, runs real replays (and failing ones) through the built CLI or the operator, and
//! searches for both passwords in everything that came out: stdout and stderr (logs at `debug`
//! and `trace`), the printed resource and status, `audit` exports, the raw audit rows and state
//! in Redis, the messages themselves, and the operator's status writes, Events and logs.
//!
//! A password is searched for as written, percent-encoded, as the byte list `Debug` prints for a
//! `&[u8]` (how lapin would log a SASL PLAIN response), and, for Secrets, as the base64 of the
//! URL that holds it.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use dlq_replay::api::DlqReplay;
use dlq_replay_testkit::cluster::Cluster;
use dlq_replay_testkit::world::*;
use futures::StreamExt as _;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde_json::{json, Value};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_dlq-replay"))
}

fn hex8() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_string()
}

/// A RabbitMQ user and a Redis ACL user of one test, each with its own unique password; both
/// are deleted when this is dropped (a failing test included).
struct Users {
    amqp_user: String,
    amqp_password: String,
    redis_user: String,
    redis_password: String,
    /// Other strings that must appear nowhere (the wrong passwords a test tries).
    also: Vec<String>,
}

impl Users {
    fn create(test: &str) -> Users {
        let u = Users {
            amqp_user: format!("dlqr-{test}-{}", hex8()),
            amqp_password: format!("pw-{}", uuid::Uuid::new_v4().simple()),
            redis_user: format!("dlqr-{test}-{}", hex8()),
            redis_password: format!("rpw-{}", uuid::Uuid::new_v4().simple()),
            also: Vec::new(),
        };
        must("rabbitmqctl", &["add_user", &u.amqp_user, &u.amqp_password]);
        must(
            "rabbitmqctl",
            &["set_permissions", "-p", "/", &u.amqp_user, ".*", ".*", ".*"],
        );
        must(
            "redis-cli",
            &[
                "ACL",
                "SETUSER",
                &u.redis_user,
                "on",
                &format!(">{}", u.redis_password),
                "~*",
                "&*",
                "+@all",
            ],
        );
        u
    }

    fn amqp(&self) -> String {
        self.amqp_with(&self.amqp_password, "%2f")
    }

    fn amqp_with(&self, password: &str, vhost: &str) -> String {
        format!(
            "amqp://{}:{password}@127.0.0.1:5672/{vhost}",
            self.amqp_user
        )
    }

    fn redis(&self) -> String {
        self.redis_with(&self.redis_password, 6379)
    }

    fn redis_with(&self, password: &str, port: u16) -> String {
        format!("redis://{}:{password}@127.0.0.1:{port}/", self.redis_user)
    }

    /// A wrong password to try, which must not appear anywhere either.
    fn wrong(&mut self) -> String {
        let p = format!("wrong-{}", uuid::Uuid::new_v4().simple());
        self.also.push(p.clone());
        p
    }

    /// Panic, naming `what` and showing the line, when any form of any password is in `text`.
    fn assert_absent(&self, what: &str, text: &str) {
        let mut secrets = vec![self.amqp_password.clone(), self.redis_password.clone()];
        secrets.extend(self.also.iter().cloned());
        for secret in &secrets {
            let bytes = format!("{:?}", secret.as_bytes());
            let bytes = bytes.trim_start_matches('[').trim_end_matches(']');
            let encoded: String = url::form_urlencoded::byte_serialize(secret.as_bytes()).collect();
            for form in [secret.as_str(), bytes, encoded.as_str()] {
                if let Some(at) = text.find(form) {
                    let start = text[..at].rfind('\n').map(|i| i + 1).unwrap_or(0);
                    let end = text[at..].find('\n').map(|i| at + i).unwrap_or(text.len());
                    let line: String = text[start..end].chars().take(600).collect();
                    panic!("a password ({form}) is in {what}:\n{line}");
                }
            }
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        for url in [self.amqp(), self.redis()] {
            let encoded = b64.encode(&url);
            assert!(
                !text.contains(&encoded),
                "a Secret's URL (base64) is in {what}"
            );
        }
    }
}

impl Drop for Users {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_user", &self.amqp_user])
            .output();
        let _ = std::process::Command::new("redis-cli")
            .args(["ACL", "DELUSER", &self.redis_user])
            .output();
    }
}

/// `w`'s manifest with the broker at `amqp` and audit trail, state and claims at `redis`
/// (inline URLs), written to `dir`.
fn manifest_file(dir: &Path, w: &World, amqp: &str, redis: &str, extra: &str) -> PathBuf {
    let resource = manifest_of(w, amqp, redis, extra);
    let file = dir.join(format!("{}-{}.yaml", w.tag, hex8()));
    std::fs::write(&file, serde_yaml::to_string(&resource).expect("yaml")).expect("write");
    file
}

fn manifest_of(w: &World, amqp: &str, redis: &str, extra: &str) -> DlqReplay {
    let mut resource = w.manifest(&format!(
        "  audit: {{redis: {{url: \"{redis}\"}}}}\n  poison: {{requiredFields: [/id]}}\n{}{extra}",
        w.idempotency("Claim")
    ));
    resource.spec.broker.url = Some(amqp.into());
    resource
}

/// The CLI, `RUST_LOG` at `log`, no URLs from this process's environment but `env`.
async fn cli(args: &[&str], log: &str, env: &[(&str, &str)]) -> Output {
    let mut cmd = tokio::process::Command::new(bin());
    cmd.args(args)
        .env("RUST_LOG", log)
        .env_remove("AMQP_URL")
        .env_remove("REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("the CLI finished within 2 minutes")
        .expect("run the CLI")
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Every field of every entry of a Redis stream, and of a hash, as text.
async fn raw_redis(w: &World, stream: &str, hash: &str) -> String {
    let mut r = w.redis.clone();
    let rows: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut r)
        .await
        .expect("XRANGE");
    let state: redis::Value = redis::cmd("HGETALL")
        .arg(hash)
        .query_async(&mut r)
        .await
        .expect("HGETALL");
    let text = format!("{rows:?}\n{state:?}");
    assert!(
        text.contains("replayed"),
        "no audit rows in {stream}: {text}"
    );
    text
}

async fn replay_and_export(log: &str) {
    let users = Users::create(&format!("s{}", &log[..1]));
    let w = World::new(&format!("secrets-{log}")).await;
    let mut jobs: Vec<_> = (0..10).map(|i| job(&format!("s{i}"), json!({}))).collect();
    jobs.push(job("poison", json!({})));
    jobs.last_mut().expect("a job").1 = b"not json".to_vec();
    w.dead_letter(jobs).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = manifest_file(dir.path(), &w, &users.amqp(), &users.redis(), "");
    let f = path(&file);

    for args in [&["plan", "-f", f][..], &["plan", "--json", "-f", f][..]] {
        let out = cli(args, log, &[]).await;
        assert!(out.status.success(), "{}", output_text(&out));
        users.assert_absent(
            &format!("`{}` at {log}", args.join(" ")),
            &output_text(&out),
        );
    }

    let out = cli(&["run", "--no-progress", "-o", "json", "-f", f], log, &[]).await;
    let all = output_text(&out);
    assert!(out.status.success(), "{all}");
    users.assert_absent(&format!("`run -o json` at {log}"), &all);
    let printed: Value = serde_json::from_slice(&out.stdout).expect("the resource as JSON");
    let status = &printed["status"];
    assert_eq!(status["phase"], "Done", "{all}");
    assert_eq!(status["counts"]["replayed"], 10, "{all}");
    assert_eq!(status["counts"]["quarantined"], 1, "{all}");
    // The printed resource still says where it ran, with the passwords masked.
    assert_eq!(
        printed["spec"]["broker"]["url"],
        format!("amqp://{}:***@127.0.0.1:5672/%2f", users.amqp_user),
        "{all}"
    );

    // A finished replay run again prints its stored result (YAML this time).
    let out = cli(&["run", "--no-progress", "-f", f], log, &[]).await;
    assert!(out.status.success(), "{}", output_text(&out));
    users.assert_absent(&format!("the rerun's YAML at {log}"), &output_text(&out));

    for format in ["jsonl", "csv"] {
        let out = cli(&["audit", "--format", format, "-f", f], log, &[]).await;
        assert!(out.status.success(), "{}", output_text(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).lines().count(),
            if format == "csv" { 12 } else { 11 },
            "{}",
            output_text(&out)
        );
        users.assert_absent(
            &format!("`audit --format {format}` at {log}"),
            &output_text(&out),
        );
    }
    let audit_key = status["audit"]["key"].as_str().expect("status.audit.key");
    let state_key = dlq_replay::engine::store::Keys::state_of("tests", &w.tag);
    users.assert_absent(
        "the raw audit rows and state in Redis",
        &raw_redis(&w, audit_key, &state_key).await,
    );
    let target = w.take(&w.topo.work).await;
    assert_eq!(target.len(), 10);
    let quarantine = w.take(&w.topo.quarantine).await;
    assert_eq!(quarantine.len(), 1);
    users.assert_absent(
        "the replayed and quarantined messages",
        &format!("{target:?}\n{quarantine:?}"),
    );
    w.cleanup().await;
}

#[tokio::test]
async fn run_plan_and_audit_at_debug_print_log_and_store_no_password() {
    replay_and_export("debug").await;
}

#[tokio::test]
async fn run_plan_and_audit_at_trace_print_log_and_store_no_password() {
    replay_and_export("trace").await;
}

#[tokio::test]
async fn failing_runs_say_why_without_the_password() {
    let mut users = Users::create("fail");
    let w = World::new("secrets-fail").await;
    w.dead_letter((0..3).map(|i| job(&format!("f{i}"), json!({}))).collect())
        .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (amqp, redis) = (users.amqp(), users.redis());
    let wrong_amqp = users.wrong();
    let wrong_redis = users.wrong();
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let cases: Vec<(&str, PathBuf, &str)> = vec![
        (
            "a vhost that does not exist",
            manifest_file(
                dir.path(),
                &w,
                &users.amqp_with(&users.amqp_password, "no-such-vhost"),
                &redis,
                "",
            ),
            "broker",
        ),
        (
            "a wrong broker password",
            manifest_file(
                dir.path(),
                &w,
                &users.amqp_with(&wrong_amqp, "%2f"),
                &redis,
                "",
            ),
            "broker",
        ),
        (
            "a wrong Redis password",
            manifest_file(
                dir.path(),
                &w,
                &amqp,
                &users.redis_with(&wrong_redis, 6379),
                "",
            ),
            "redis",
        ),
        (
            "Redis on a closed port",
            manifest_file(
                dir.path(),
                &w,
                &amqp,
                &users.redis_with(&users.redis_password, closed),
                "",
            ),
            "redis",
        ),
        (
            "a missing source queue",
            {
                let text = serde_yaml::to_string(&manifest_of(&w, &amqp, &redis, ""))
                    .expect("yaml")
                    .replace(&w.topo.dlq, &format!("{}.missing", w.topo.dlq));
                let file = dir.path().join("missing.yaml");
                std::fs::write(&file, text).expect("write");
                file
            },
            "does not exist",
        ),
    ];
    for (what, file, says) in &cases {
        for command in [
            &["run", "--no-progress", "--reconnect-timeout", "0", "-f"][..],
            &["plan", "-f"][..],
        ] {
            let mut args = command.to_vec();
            args.push(path(file));
            let out = cli(&args, "debug", &[]).await;
            let all = output_text(&out);
            assert!(!out.status.success(), "{what}: {all}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            // The CLI's own last word (library logs may follow it on stderr).
            let last = stderr
                .lines()
                .rfind(|l| l.starts_with("error: ") || l.starts_with("replay ended"))
                .unwrap_or_default()
                .to_string();
            eprintln!("{what} ({}): {last}", command[0]);
            assert!(
                last.to_lowercase().contains(says),
                "{what}: the error does not say {says:?}: {all}"
            );
            users.assert_absent(&format!("`{}` with {what}", command[0]), &all);
        }
    }

    // The stand-ins for the Secrets, from the environment and the command line.
    let file = manifest_file(dir.path(), &w, &amqp, &redis, "");
    let wrong_url = users.amqp_with(&wrong_amqp, "%2f");
    let out = cli(
        &["run", "--no-progress", "-f", path(&file)],
        "debug",
        &[("AMQP_URL", &wrong_url)],
    )
    .await;
    assert!(!out.status.success(), "{}", output_text(&out));
    users.assert_absent("a wrong AMQP_URL", &output_text(&out));
    let out = cli(
        &[
            "plan",
            "-f",
            path(&file),
            "--redis-url",
            &format!("http://{wrong_redis}@x/"),
        ],
        "debug",
        &[],
    )
    .await;
    assert!(!out.status.success(), "{}", output_text(&out));
    users.assert_absent("a --redis-url of the wrong scheme", &output_text(&out));
    // A URL where the manifest wants a map: serde quotes the value, the manifest masks it.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        format!(
            "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {{name: bad}}\nspec:\n  broker: \"{amqp}\"\n  source: {{queue: q}}\n"
        ),
    )
    .expect("write");
    let out = cli(&["plan", "-f", path(&bad)], "debug", &[]).await;
    assert!(!out.status.success(), "{}", output_text(&out));
    users.assert_absent(
        "a manifest with a URL in the wrong place",
        &output_text(&out),
    );

    // Nothing was touched by any of it.
    assert_eq!(w.depth(&w.topo.dlq).await, 3);
    assert_eq!(w.depth(&w.topo.work).await, 0);
    w.cleanup().await;
}

/// Every version of every DlqReplay of `ns` the API server hands out, as text.
fn record_versions(api: Api<DlqReplay>) -> (Arc<Mutex<String>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(String::new()));
    let into = seen.clone();
    let task = tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default()).boxed();
        while let Some(event) = events.next().await {
            if let Ok(event) = event {
                let mut s = into.lock().unwrap_or_else(|e| e.into_inner());
                s.push_str(&format!("{event:?}\n"));
            }
        }
    });
    (seen, task)
}

fn operator_resource(w: &World, ns: &str, name: &str, broker: &str, redis: &str) -> DlqReplay {
    let text = format!(
        "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  broker: {{urlSecretRef: {{name: {broker}, key: url}}}}\n  source: {{queue: {dlq}}}\n  quarantine: {{queue: {q}}}\n  audit: {{redis: {{urlSecretRef: {{name: {redis}, key: url}}}}}}\n  canary: {{enabled: false}}\n{idem}",
        dlq = w.topo.dlq,
        q = w.topo.quarantine,
        idem = w.idempotency("Claim"),
    );
    dlq_replay::manifest::parse(&text).unwrap_or_else(|e| panic!("{e}"))
}

async fn wait_until(api: &Api<DlqReplay>, name: &str, f: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let r = api.get(name).await.expect("get");
        let status = serde_json::to_value(&r.status).expect("status json");
        if f(&status) {
            return status;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{name}: gave up waiting; status {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_operator_keeps_passwords_out_of_status_events_and_logs() {
    let mut users = Users::create("op");
    let c = Cluster::fake().await;
    let ns = c.ns().to_string();
    let (ok, bad_broker, bad_redis) = (
        World::new("secrets-op").await,
        World::new("secrets-op-amqp").await,
        World::new("secrets-op-redis").await,
    );
    for w in [&ok, &bad_broker, &bad_redis] {
        w.dead_letter((0..5).map(|i| job(&format!("o{i}"), json!({}))).collect())
            .await;
    }
    let (wrong_amqp, wrong_redis) = (users.wrong(), users.wrong());
    let wrong_amqp = users.amqp_with(&wrong_amqp, "%2f");
    let wrong_redis = users.redis_with(&wrong_redis, 6379);
    c.put_secret(&ns, "rabbitmq", &[("url", &users.amqp())])
        .await;
    c.put_secret(&ns, "redis", &[("url", &users.redis())]).await;
    c.put_secret(&ns, "rabbitmq-wrong", &[("url", &wrong_amqp)])
        .await;
    c.put_secret(&ns, "redis-wrong", &[("url", &wrong_redis)])
        .await;

    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("operator.log");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let mut operator = tokio::process::Command::new(bin())
        .args(["operator", "--namespace", &ns, "--no-leader-election"])
        .args(["--http-addr", &format!("127.0.0.1:{port}")])
        .env("KUBECONFIG", c.kubeconfig(dir.path()))
        .env("RUST_LOG", "debug")
        .stdout(std::fs::File::create(dir.path().join("operator.out")).expect("log file"))
        .stderr(std::fs::File::create(&log).expect("log file"))
        .kill_on_drop(true)
        .spawn()
        .expect("the operator");

    let api: Api<DlqReplay> = Api::namespaced(c.client(), &ns);
    let (versions, recorder) = record_versions(api.clone());
    for (w, name, broker, redis) in [
        (&ok, "ok", "rabbitmq", "redis"),
        (&bad_broker, "bad-broker", "rabbitmq-wrong", "redis"),
        (&bad_redis, "bad-redis", "rabbitmq", "redis-wrong"),
    ] {
        api.create(
            &PostParams::default(),
            &operator_resource(w, &ns, name, broker, redis),
        )
        .await
        .expect("create");
    }
    let done = wait_until(&api, "ok", |s| s["phase"] == "Done").await;
    assert_eq!(done["counts"]["replayed"], 5, "{done}");
    let unavailable = |s: &Value| {
        s["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("Unavailable"))
    };
    let broker = wait_until(&api, "bad-broker", unavailable).await;
    let redis = wait_until(&api, "bad-redis", unavailable).await;
    eprintln!(
        "bad-broker: {}\nbad-redis: {}",
        broker["message"], redis["message"]
    );
    assert!(
        broker["message"]
            .as_str()
            .is_some_and(|m| m.contains("broker")),
        "{broker}"
    );
    assert!(
        redis["message"]
            .as_str()
            .is_some_and(|m| m.contains("redis")),
        "{redis}"
    );
    // Events follow the status writes: wait for the Done and the Pending ones.
    let t = Instant::now();
    let events = loop {
        let events = c.events(&ns).await;
        let reasons: Vec<&str> = events.iter().filter_map(|e| e["reason"].as_str()).collect();
        if (reasons.contains(&"Done") && reasons.contains(&"Pending"))
            || t.elapsed() > Duration::from_secs(10)
        {
            break events;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let events = serde_json::to_string_pretty(&events).expect("events json");
    assert!(events.contains("\"Done\""), "{events}");
    users.assert_absent("the Events", &events);

    for name in ["ok", "bad-broker", "bad-redis"] {
        assert!(
            c.status_writes(&ns, name).unwrap_or(0) > 0,
            "{name}: no status writes"
        );
        let stored = c.get_json("dlqreplays", &ns, name).await.expect("stored");
        users.assert_absent(&format!("the stored {name}"), &stored.to_string());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    recorder.abort();
    let versions = versions.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert!(
        versions.contains("Done") && versions.contains("Unavailable"),
        "the watch saw no status writes: {versions}"
    );
    users.assert_absent("the status writes (every version watched)", &versions);

    let _ = operator.kill().await;
    let logs = std::fs::read_to_string(&log).expect("operator log")
        + &std::fs::read_to_string(dir.path().join("operator.out")).expect("operator stdout");
    assert!(!logs.is_empty(), "the operator logged nothing at debug");
    users.assert_absent("the operator's logs at debug", &logs);

    assert_eq!(ok.take(&ok.topo.work).await.len(), 5);
    c.cleanup().await;
    for w in [ok, bad_broker, bad_redis] {
        w.cleanup().await;
    }
}
