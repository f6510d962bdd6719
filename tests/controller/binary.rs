//! The operator binary as a child process: driven from a kubeconfig, serving /metrics, /healthz and
//! /readyz, and SIGTERM to the leader mid-drain.

use super::*;

pub(crate) fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

pub(crate) async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let _ = s
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

pub(crate) async fn the_operator_binary_drives_a_replay_from_a_kubeconfig_and_serves_metrics(
    c: &Cluster,
) {
    let w = World::new("ctl-binary").await;
    w.dead_letter((0..200).map(|i| job(&format!("o{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = c.kubeconfig(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"))
        .args([
            "operator",
            "--namespace",
            c.ns(),
            "--http-addr",
            &format!("127.0.0.1:{port}"),
            "--lease-namespace",
            c.ns(),
        ])
        .env("KUBECONFIG", &kubeconfig)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let t = Instant::now();
    while !http_get(port, "/readyz").await.contains("200 OK") {
        assert!(t.elapsed() < Duration::from_secs(20), "never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = rss_kib(pid);
    let api = replays(c);
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "bin", "  rate: {messagesPerSecond: 100}\n"),
    )
    .await
    .unwrap();
    let mut draining = 0;
    loop {
        let r = api.get("bin").await.unwrap();
        match phase(&r) {
            Some(Phase::Done) => break,
            Some(Phase::Draining) => draining = draining.max(rss_kib(pid)),
            _ => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(40),
            "no Done: {:?}",
            r.status
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("operator RSS: idle {idle} KiB, draining (peak seen) {draining} KiB");
    // The operator counts a status into its metrics once the API server has taken the write,
    // so a scrape right after `Done` is seen can precede it: wait for the counts (5 s at most).
    let mut metrics = http_get(port, "/metrics").await;
    let t = Instant::now();
    while !metrics.contains("dlq_replay_messages_total{decision=\"replayed\"} 200")
        && t.elapsed() < Duration::from_secs(5)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        metrics = http_get(port, "/metrics").await;
    }
    assert!(
        metrics
            .to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{metrics}"
    );
    assert!(metrics.trim_end().ends_with("# EOF"), "{metrics}");
    assert!(http_get(port, "/healthz").await.contains("200 OK"));
    assert!(
        metrics.contains("dlq_replay_messages_total{decision=\"replayed\"} 200"),
        "{metrics}"
    );
    assert!(metrics.contains("dlq_replay_leader 1"), "{metrics}");
    // The per-replay series the alerts and the dashboard read (deploy/monitoring).
    assert!(
        metrics.contains(r#"name="bin",phase="Done"}"#)
            && metrics.contains(r#"name="bin",of="replayed"} 200"#),
        "{metrics}"
    );
    assert_eq!(w.take(&w.topo.work).await.len(), 200);
    let _ = child.kill().await;
    w.cleanup().await;
}

/// A free local port.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The operator binary as one replica: it watches the test's namespace and holds its Lease there,
/// serves /metrics, /healthz and /readyz on `port`; its stderr is collected by `log`.
pub(crate) struct Replica {
    name: String,
    port: u16,
    child: tokio::process::Child,
    log: tokio::task::JoinHandle<String>,
}

pub(crate) async fn replica(
    c: &Cluster,
    kubeconfig: &std::ffi::OsStr,
    name: &str,
    extra: &[&str],
) -> Replica {
    use tokio::io::AsyncReadExt;
    let port = free_port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlq-replay"))
        .args([
            "operator",
            "--namespace",
            c.ns(),
            "--http-addr",
            &format!("127.0.0.1:{port}"),
            "--lease-namespace",
            c.ns(),
            "--instance",
            name,
            "--status-interval",
            "1",
        ])
        .args(extra)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    // Read as it comes, so that the pipe never fills up.
    let log = tokio::spawn(async move {
        let mut out = Vec::new();
        let _ = stderr.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    });
    let t = Instant::now();
    while !http_get(port, "/readyz").await.contains("200 OK") {
        assert!(t.elapsed() < Duration::from_secs(20), "{name} never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Replica {
        name: name.into(),
        port,
        child,
        log,
    }
}

impl Replica {
    /// SIGTERM, then how long it took to exit and its exit status (`None`: still running after
    /// `within`, then killed).
    async fn terminate(
        &mut self,
        within: Duration,
    ) -> (Duration, Option<std::process::ExitStatus>) {
        let pid = self
            .child
            .id()
            .unwrap_or_else(|| panic!("{} is not running", self.name));
        let t = Instant::now();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(status) => (t.elapsed(), Some(status.unwrap())),
            Err(_) => {
                let _ = self.child.kill().await;
                (t.elapsed(), None)
            }
        }
    }

    async fn log(self) -> String {
        self.log.await.unwrap()
    }
}

pub(crate) async fn sigterm_to_the_leading_operator_mid_drain_exits_0_and_the_other_replica_finishes(
    c: &Cluster,
) {
    sigterm_mid_drain(c, 60, "  rate: {messagesPerSecond: 20}\n", 5).await;
}

/// `n` jobs replayed in Claim mode (`rate` is YAML under spec, or empty) by two operator
/// binaries; SIGTERM to the leader once `progress` are replayed. Prints the durations.
pub(crate) async fn sigterm_mid_drain(c: &Cluster, n: u64, rate: &str, progress: u64) {
    let w = World::new("ctl-sigterm").await;
    w.dead_letter((0..n).map(|i| job(&format!("t{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = c.kubeconfig(dir.path());
    let mut a = replica(c, &kubeconfig, "op-a", &["--log-format", "json"]).await;
    let t = Instant::now();
    while lease_holder(c).await.as_deref() != Some("op-a") {
        assert!(t.elapsed() < Duration::from_secs(20), "op-a never led");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = replica(c, &kubeconfig, "op-b", &[]).await;
    // A follower stops at once, and leaves the Lease alone.
    let mut f = replica(c, &kubeconfig, "op-f", &[]).await;
    let (took, exit) = f.terminate(Duration::from_secs(10)).await;
    eprintln!(
        "shutdown of a following replica: SIGTERM -> exit {} ms",
        took.as_millis()
    );
    assert_eq!(exit.and_then(|e| e.code()), Some(0), "{exit:?}");
    assert_eq!(lease_holder(c).await.as_deref(), Some("op-a"));
    let api = replays(c);
    let extra = format!("{}{rate}", w.idempotency("Claim"));
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "term", &extra),
    )
    .await
    .unwrap();
    let before = wait_for(&api, "term", "some progress", |r| {
        phase(r) == Some(Phase::Draining)
            && r.status
                .as_ref()
                .is_some_and(|s| s.counts.replayed >= progress)
    })
    .await;
    let id = before.status.unwrap().replay.replay_id;
    let (shutdown, exit) = a.terminate(Duration::from_secs(10)).await;
    let exited = Instant::now();
    eprintln!(
        "shutdown of the leading replica: SIGTERM -> exit {} ms ({exit:?})",
        shutdown.as_millis()
    );
    let exit = exit.expect("still running 10 s after SIGTERM");
    assert_eq!(exit.code(), Some(0), "{exit:?}");
    assert_ne!(
        lease_holder(c).await.as_deref(),
        Some("op-a"),
        "the Lease was not released"
    );
    // What op-a left (op-b takes over at its next ask, 2 s at most).
    let stopped_at = api.get("term").await.unwrap().status.unwrap().counts;
    eprintln!(
        "stopped with {} of {n} replayed; {}",
        stopped_at.replayed,
        dlq_replay::engine::summary(&stopped_at)
    );
    let log = a.log().await;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| {
            panic!("--log-format json wrote a line that is not JSON ({e}): {line}")
        });
        assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
    }
    assert!(log.contains("graceful shutdown requested"), "{log}");
    assert!(log.contains("released the lease"), "{log}");
    // The stop is the operator's: the replay waits for the next leader, and says so.
    let stopped = |e: &Value| {
        e["reportingInstance"] == "op-a"
            && e["note"]
                .as_str()
                .is_some_and(|n| n.starts_with("OperatorStopped:"))
    };
    let events = events_once(c, |es| es.iter().any(stopped)).await;
    assert!(events.iter().any(stopped), "{events:?}");
    while lease_holder(c).await.as_deref() != Some("op-b") {
        assert!(exited.elapsed() < Duration::from_secs(10), "op-b never led");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "takeover: op-a exited -> op-b holds the Lease {} ms",
        exited.elapsed().as_millis()
    );
    let r = wait_for(&api, "term", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let metrics = http_get(b.port, "/metrics").await;
    assert!(metrics.contains("dlq_replay_leader 1"), "{metrics}");
    // The per-replay series the alerts and the dashboard read (deploy/monitoring), from the
    // replica that finished it.
    let replayed = r.status.as_ref().map_or(0, |s| s.counts.replayed);
    assert!(
        metrics.contains(r#"name="term",phase="Done"}"#)
            && metrics.contains(&format!(r#"name="term",of="replayed"}} {replayed}"#)),
        "{metrics}"
    );
    assert!(http_get(b.port, "/healthz").await.contains("200 OK"));
    let s = r.status.unwrap();
    assert_eq!(
        s.replay_id, id,
        "the other replica must resume the same replay"
    );
    let target = w.take(&w.topo.work).await;
    assert_each_key_once(&target);
    // A clean stop leaves no outcome unknown: nothing is quarantined, every job replayed once.
    assert_eq!(w.depth(&w.topo.quarantine).await, 0, "{s:?}");
    assert_eq!(target.len() as u64, n, "{s:?}");
    assert_eq!((s.counts.replayed, s.counts.quarantined), (n, 0), "{s:?}");
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    // The follower's logs are text, and without colour codes: its stderr is not a terminal.
    let mut b = b;
    let (_, exit_b) = b.terminate(Duration::from_secs(10)).await;
    assert_eq!(exit_b.and_then(|e| e.code()), Some(0));
    let log_b = b.log().await;
    assert!(
        !log_b.contains('\u{1b}'),
        "ANSI codes in a log written to a pipe"
    );
    assert!(log_b.contains("leading: driving replays"), "{log_b}");
    w.cleanup().await;
}
