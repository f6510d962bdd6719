//! Faults of Redis: a Redis of the test's own ([`OwnRedis`]), paused and killed mid-drain.

use super::*;

/// A Redis of a scenario's own on a free port, so pausing or killing it touches nobody else.
pub struct OwnRedis {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
    /// More `redis-server` arguments, e.g. a `maxmemory-policy`.
    extra: Vec<String>,
}

impl OwnRedis {
    /// Start one that writes every change to its append-only file before answering (so a
    /// `kill -9` loses nothing it acknowledged), like a production Redis holding claims should.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`OwnRedis::start`] with more `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let mut r = OwnRedis {
            port,
            dir: tempfile::tempdir().expect("tempdir"),
            child: None,
            extra: extra.iter().map(|a| a.to_string()).collect(),
        };
        r.spawn();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The URL as `user` with `password` (an ACL user).
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("redis://{user}:{password}@127.0.0.1:{}/", self.port)
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server");
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "own redis did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill_9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn restart(&mut self) {
        self.spawn();
    }

    /// `CLIENT PAUSE ms ALL`: every client's commands wait.
    pub fn pause(&self, ms: u64) {
        let out = Command::new("redis-cli")
            .args([
                "-p",
                &self.port.to_string(),
                "client",
                "pause",
                &ms.to_string(),
                "all",
            ])
            .output()
            .expect("redis-cli");
        assert!(out.status.success());
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.kill_9();
    }
}

/// Fault 3a: Redis stops answering (`CLIENT PAUSE ALL`) for `pause` mid-drain. While it is
/// paused nothing is acked and nothing published past the batch already checked; then the
/// replay goes on (waiting, or reconnecting when the pause outlasts the response timeout).
pub async fn redis_pause(
    w: &World,
    mode: &'static str,
    n: usize,
    rate: u32,
    pause: Duration,
) -> Tally {
    let redis = OwnRedis::start();
    let (task, progress) = start_watched_drain(w, mode, n, rate, Some(&redis.url())).await;
    let messages = messages_of(progress);
    until_depth(w, &w.topo.work, n / 4, Duration::from_secs(120)).await;
    let retries_before = redis_retries();
    redis.pause(pause.as_millis() as u64);
    let paused = Instant::now();
    // The batch in flight when the pause began may still publish and wait; after that, nothing
    // moves until Redis answers again. Both looks (rabbitmqctl takes ~0.5 s) must end inside
    // the pause.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (target_a, dlq_a) = (w.depth(&w.topo.work).await, dlq_total(w, &w.topo.dlq).await);
    // rabbitmqctl boots an Erlang VM first (twice for a quorum DLQ, through the RabbitMQ 4
    // chroot): give the second look the second half of the pause.
    let second = (pause / 2).max(Duration::from_millis(1500));
    tokio::time::sleep(second.saturating_sub(paused.elapsed())).await;
    let (target_b, dlq_b) = (w.depth(&w.topo.work).await, dlq_total(w, &w.topo.dlq).await);
    let looked = paused.elapsed();
    let mut problems = Vec::new();
    if looked >= pause {
        problems.push(format!(
            "the second look ended {looked:?} after the pause began, not inside it"
        ));
    }
    if target_b != target_a {
        problems.push(format!(
            "published while Redis was paused: {target_a} → {target_b}"
        ));
    }
    if dlq_b != dlq_a {
        problems.push(format!(
            "acked while Redis was paused: {dlq_a:?} → {dlq_b:?}"
        ));
    }
    let status = ended(task, &mut problems).await;
    // Counted process-wide: another scenario running beside this one may add to it, but a
    // pause past the engine's 5 s Redis timeout must have made this one ask again.
    let retried = redis_retries() - retries_before;
    let said = messages.await.unwrap_or_default();
    let waiting = said.iter().any(|m| m.starts_with("WaitingForRedis:"));
    if pause > Duration::from_secs(6) && (retried == 0 || !waiting) {
        problems.push(format!(
            "Redis was paused {pause:?}, past the 5 s timeout, yet {retried} Redis calls were asked again and the status said (besides \"replaying, …\") {:?}",
            said.iter().filter(|m| !m.starts_with("replaying")).collect::<Vec<_>>()
        ));
    }
    finish_on(w, &redis.url(), &w.topo.work.clone(), "redis CLIENT PAUSE ALL", mode, n, 1, &status, &mut problems, |p, problems| {
        no_unknown_after_redis_came_back(p, problems);
        format!(
            "paused {:.1}s; from 0.6s to {:.1}s of it: target {target_a}→{target_b}, DLQ {}→{}; {retried} Redis calls asked again; {} OutcomeUnknown",
            pause.as_secs_f64(),
            looked.as_secs_f64(),
            dlq_a.unwrap_or(0),
            dlq_b.unwrap_or(0),
            p.unknown()
        )
    })
    .await
}

/// Redis calls asked again after a lost answer, so far in this process.
pub(super) fn redis_retries() -> u64 {
    let m = dlq_replay_operator::metrics::Metrics::global();
    ["redis_lookup", "redis_commit"]
        .map(|of| {
            m.retries
                .get_or_create(&dlq_replay_operator::metrics::RetryLabel { of: of.into() })
                .get()
        })
        .iter()
        .sum()
}

/// A Redis that is back within the reconnect budget costs no outcome: the lookup or commit
/// whose answer was lost is asked again, the batch's messages held meanwhile.
pub(super) fn no_unknown_after_redis_came_back(p: &Places, problems: &mut Vec<String>) {
    if p.unknown() > 0 {
        problems.push(format!(
            "{} messages quarantined OutcomeUnknown although Redis came back",
            p.unknown()
        ));
    }
}

/// Fault 3b: the replay's Redis is killed (`kill -9`) mid-drain and started again after
/// `down`; the replay reconnects and finishes.
pub async fn redis_restart(
    w: &World,
    mode: &'static str,
    n: usize,
    rate: u32,
    down: Duration,
) -> Tally {
    let mut redis = OwnRedis::start();
    let task = start_drain(w, mode, n, rate, Some(&redis.url())).await;
    until_depth(w, &w.topo.work, n / 4, Duration::from_secs(120)).await;
    redis.kill_9();
    let dlq_down = dlq_total(w, &w.topo.dlq).await;
    tokio::time::sleep(down).await;
    let dlq_up = dlq_total(w, &w.topo.dlq).await;
    redis.restart();
    let mut problems = Vec::new();
    if dlq_up > dlq_down {
        problems.push(format!(
            "DLQ grew while Redis was down: {dlq_down:?} → {dlq_up:?}"
        ));
    }
    let status = ended(task, &mut problems).await;
    finish_on(
        w,
        &redis.url(),
        &w.topo.work.clone(),
        "redis kill -9, restart",
        mode,
        n,
        1,
        &status,
        &mut problems,
        |p, problems| {
            no_unknown_after_redis_came_back(p, problems);
            format!(
                "down {:.1}s; {} OutcomeUnknown",
                down.as_secs_f64(),
                p.unknown()
            )
        },
    )
    .await
}
