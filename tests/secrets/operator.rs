//! The operator: its status writes, Events and logs hold no password.

use super::*;

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
