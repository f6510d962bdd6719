//! The CLI: `run`, `plan` and `audit` at `debug` and `trace`, and failing runs, print, log and store
//! no password.

use super::*;

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
    let state_key = dlq_replay::engine::store::Keys::state_of(w.redis.layout(), "tests", &w.tag);
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
