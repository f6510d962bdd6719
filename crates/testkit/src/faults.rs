//! Fault scenarios, shared by `tests/faults.rs` (at sizes that fit CI) and `make faults`
//! (`examples/faults.rs`, at full size, printing the table).
//!
//! Each scenario dead-letters its own messages (ids `f00000`…), breaks something while a real
//! replay drains them, lets the replay (or its rerun) finish, then finds every message again —
//! in the target, the quarantine queue, the DLQ, or dropped as a duplicate with its audit row —
//! and checks the counts against the audit trail. The result is a [`Tally`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dlq_replay_api::{Phase, ReplayStatus};
use dlq_replay_engine::{self as engine, store, Options, Replay};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::ExchangeKind;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::world::*;

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Tally {
    pub fault: String,
    /// Runs of the replay (a kill -9 ends one; a reconnect does not).
    pub runs: usize,
    pub messages: usize,
    /// Messages found nowhere afterwards: must be 0.
    pub lost: usize,
    /// Idempotency keys found in the target more than once: must be 0 in Claim mode.
    pub twice: usize,
    pub mode: &'static str,
    /// What else the scenario saw (quarantined OutcomeUnknown, failed, phase...).
    pub detail: String,
    /// Invariants that did not hold (empty when all did).
    pub problems: Vec<String>,
}

impl Tally {
    pub fn ok(&self) -> bool {
        self.lost == 0 && (self.mode != "Claim" || self.twice == 0) && self.problems.is_empty()
    }

    pub fn assert_ok(&self) {
        assert!(self.ok(), "{self:#?}");
        eprintln!("{}", self.line());
    }

    pub fn header() -> String {
        format!(
            "{:<44} {:>5} {:>6} {:>8} {:>5} {:>11}  {}",
            "fault", "mode", "runs", "messages", "lost", "keys twice", "detail"
        )
    }

    pub fn line(&self) -> String {
        format!(
            "{:<44} {:>5} {:>6} {:>8} {:>5} {:>11}  {}{}",
            self.fault,
            self.mode,
            self.runs,
            self.messages,
            self.lost,
            self.twice,
            self.detail,
            if self.problems.is_empty() {
                String::new()
            } else {
                format!("  PROBLEMS: {}", self.problems.join("; "))
            }
        )
    }
}

/// Where every message went.
#[derive(Default, Debug)]
pub struct Places {
    /// Message id → copies in the target.
    pub target: BTreeMap<String, usize>,
    pub keys_twice: usize,
    pub quarantine: BTreeMap<String, String>,
    pub dlq: BTreeSet<String>,
    pub duplicates: BTreeSet<String>,
    pub failed_reasons: Vec<String>,
}

impl Places {
    /// Take the target and the quarantine, look at the DLQ, read the audit trail.
    pub async fn collect(w: &World, target: &str, audit: &[store::AuditRow]) -> Self {
        let mut p = Places::default();
        let mut keys: BTreeMap<String, usize> = BTreeMap::new();
        for m in w.take(target).await {
            if let Some(k) = header(&m, "x-idempotency-key") {
                *keys.entry(k).or_default() += 1;
            }
            *p.target.entry(m.id).or_default() += 1;
        }
        p.keys_twice = keys.values().filter(|&&n| n > 1).count();
        for m in w.take(&w.topo.quarantine).await {
            let reason = header(&m, "x-quarantine-reason").unwrap_or_default();
            p.quarantine.insert(m.id, reason);
        }
        p.dlq = ids(&w.peek(&w.topo.dlq).await).into_iter().collect();
        for r in audit {
            match r.decision.as_str() {
                "duplicate" => {
                    p.duplicates.insert(r.message.clone());
                }
                "failed" => p.failed_reasons.push(r.reason.clone()),
                _ => {}
            }
        }
        p
    }

    pub fn lost(&self, n: usize) -> usize {
        (0..n)
            .map(id)
            .filter(|id| {
                !self.target.contains_key(id)
                    && !self.quarantine.contains_key(id)
                    && !self.dlq.contains(id)
                    && !self.duplicates.contains(id)
            })
            .count()
    }

    pub fn unknown(&self) -> usize {
        self.quarantine
            .values()
            .filter(|r| r.starts_with("OutcomeUnknown"))
            .count()
    }
}

pub fn id(i: usize) -> String {
    format!("f{i:05}")
}

/// Dead-letter `n` jobs with ids `f00000`….
pub async fn dead_letter_n(w: &World, n: usize) {
    w.dead_letter((0..n).map(|i| job(&id(i), json!({"n": i}))).collect())
        .await;
}

/// The invariants of DESIGN that hold for any finished replay: the counts add up, one audit
/// row per decided message, every message somewhere.
pub fn verify(status: &ReplayStatus, audit: &[store::AuditRow], problems: &mut Vec<String>) {
    let c = status.counts;
    if c.scanned != c.replayed + c.duplicates + c.quarantined + c.skipped + c.failed {
        problems.push(format!("counts do not add up: {c:?}"));
    }
    if audit.len() as u64 != c.scanned - c.skipped {
        problems.push(format!(
            "{} audit rows for scanned {} - skipped {}",
            audit.len(),
            c.scanned,
            c.skipped
        ));
    }
    if status.audit.as_ref().map(|a| a.records) != Some(audit.len() as u64) {
        problems.push(format!(
            "status.audit.records {:?} but {} rows",
            status.audit.as_ref().map(|a| a.records),
            audit.len()
        ));
    }
}

/// `n` distinct points in (5 %, 95 %) of `total`, sorted, from `seed`.
pub fn points(seed: u64, n: usize, total: usize) -> Vec<usize> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut set = BTreeSet::new();
    while set.len() < n {
        set.insert(rng.random_range(total / 20..total * 19 / 20));
    }
    set.into_iter().collect()
}

/// Wait until `queue` holds at least `count` messages (or `give_up` passed).
pub async fn until_depth(w: &World, queue: &str, count: usize, give_up: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < give_up {
        if w.depth(queue).await as usize >= count {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

fn write_manifest(dir: &Path, resource: &dlq_replay_api::DlqReplay) -> PathBuf {
    let file = dir.join("replay.yaml");
    std::fs::write(&file, serde_yaml::to_string(resource).unwrap()).unwrap();
    file
}

fn cli(bin: &Path, file: &Path, redis: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(["run", "--no-progress", "-o", "json", "-f"])
        .arg(file)
        .env("REDIS_URL", redis)
        .env_remove("AMQP_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

async fn run_cli_to_end(bin: &Path, file: &Path) -> Result<ReplayStatus, String> {
    let out = cli(bin, file, REDIS)
        .output()
        .await
        .map_err(|e| e.to_string())?;
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "final run printed no resource ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    serde_json::from_value(printed["status"].clone()).map_err(|e| e.to_string())
}

/// Fault 1: `kill -9` of `dlq-replay run` when the target holds each of `kill_at` messages,
/// then a rerun to the end.
pub async fn kill_9(
    w: &World,
    bin: &Path,
    mode: &'static str,
    n: usize,
    seed: u64,
    kills: usize,
) -> Tally {
    dead_letter_n(w, n).await;
    let at = points(seed, kills, n);
    let resource = w.manifest(&w.idempotency(mode));
    let dir = tempfile::tempdir().unwrap();
    let file = write_manifest(dir.path(), &resource);
    let mut killed = 0;
    for &point in &at {
        let mut child = cli(bin, &file, REDIS).spawn().expect("spawn dlq-replay");
        let reached = until_depth(w, &w.topo.work, point, Duration::from_secs(120)).await;
        if child.try_wait().ok().flatten().is_none() {
            child.start_kill().expect("kill -9");
            killed += 1;
        }
        let _ = child.wait().await;
        if !reached {
            break;
        }
    }
    let mut problems = Vec::new();
    let status = match run_cli_to_end(bin, &file).await {
        Ok(s) => s,
        Err(e) => {
            problems.push(e);
            ReplayStatus::default()
        }
    };
    finish(w, "kill -9 of dlq-replay run", mode, n, killed + 1, &status, problems, |p, problems| {
        // At most the in-flight window per kill is left unknown.
        let window = Options::default().window * killed;
        let unknown = if mode == "Claim" { p.unknown() } else { p.target.values().filter(|&&c| c > 1).count() };
        if unknown > window {
            problems.push(format!("{unknown} unknown outcomes, more than {window}"));
        }
        if mode == "Check" && !p.quarantine.is_empty() {
            problems.push(format!("{} quarantined in Check mode", p.quarantine.len()));
        }
        format!(
            "seed {seed}, {killed} kills at {at:?} target messages; {} OutcomeUnknown, {} published twice",
            p.unknown(),
            p.target.values().filter(|&&c| c > 1).count()
        )
    })
    .await
}

/// The common ending: the phase must be Done, then find every message and check the invariants.
#[allow(clippy::too_many_arguments)]
async fn finish(
    w: &World,
    fault: &str,
    mode: &'static str,
    n: usize,
    runs: usize,
    status: &ReplayStatus,
    mut problems: Vec<String>,
    extra: impl FnOnce(&Places, &mut Vec<String>) -> String,
) -> Tally {
    finish_on(
        w,
        REDIS,
        &w.topo.work.clone(),
        fault,
        mode,
        n,
        runs,
        status,
        &mut problems,
        extra,
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn finish_on(
    w: &World,
    redis_url: &str,
    target: &str,
    fault: &str,
    mode: &'static str,
    n: usize,
    runs: usize,
    status: &ReplayStatus,
    problems: &mut Vec<String>,
    extra: impl FnOnce(&Places, &mut Vec<String>) -> String,
) -> Tally {
    if status.phase != Some(Phase::Done) {
        problems.push(format!("phase {:?}: {:?}", status.phase, status.message));
    }
    let audit = match status.audit.as_ref() {
        Some(a) => {
            let mut r = store::connect(redis_url).await.expect("redis");
            store::read_audit(&mut r, &a.key).await.unwrap_or_default()
        }
        None => Vec::new(),
    };
    verify(status, &audit, problems);
    let places = Places::collect(w, target, &audit).await;
    let detail = extra(&places, problems);
    Tally {
        fault: fault.into(),
        runs,
        messages: n,
        lost: places.lost(n),
        twice: places.keys_twice,
        mode,
        detail,
        problems: std::mem::take(problems),
    }
}

/// The `rabbitmqctl` pids of this world's replay connections (on the world's broker).
fn replay_connections(w: &World) -> Vec<String> {
    let out = w
        .target
        .broker
        .ctl(&["list_connections", "pid", "client_properties", "-q"])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", w.target.broker.ctl_program()));
    let name = format!("dlq-replay tests/{} ", w.tag);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&name))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// Close every broker connection of this world's replay (`rabbitmqctl close_connection` on the
/// world's broker); returns how many there were.
pub fn close_connections(w: &World) -> usize {
    let pids = replay_connections(w);
    for pid in &pids {
        let _ = w
            .target
            .broker
            .ctl(&["close_connection", pid, "fault injection"])
            .output();
    }
    pids.len()
}

/// Dead-letter `n` jobs and start a rate-limited replay of them in this process, its state in
/// `redis_url` (the shared Redis when `None`).
async fn start_drain(
    w: &World,
    mode: &'static str,
    n: usize,
    rate: u32,
    redis_url: Option<&str>,
) -> tokio::task::JoinHandle<Result<ReplayStatus, String>> {
    start_watched_drain(w, mode, n, rate, redis_url).await.0
}

/// [`start_drain`], with the replay's progress to look at.
async fn start_watched_drain(
    w: &World,
    mode: &'static str,
    n: usize,
    rate: u32,
    redis_url: Option<&str>,
) -> (
    tokio::task::JoinHandle<Result<ReplayStatus, String>>,
    tokio::sync::watch::Receiver<ReplayStatus>,
) {
    dead_letter_n(w, n).await;
    let resource = w.manifest(&format!(
        "{}  rate: {{messagesPerSecond: {rate}}}\n",
        w.idempotency(mode)
    ));
    let replay = w.replay_on(&resource, redis_url.unwrap_or(REDIS));
    spawn_watched_engine(replay, Options::default())
}

/// Run the replay in this process (the engine, with its reconnect loop) and return its task.
pub fn spawn_engine(
    replay: Replay,
    opts: Options,
) -> tokio::task::JoinHandle<Result<ReplayStatus, String>> {
    spawn_watched_engine(replay, opts).0
}

/// [`spawn_engine`], with the replay's progress to look at.
fn spawn_watched_engine(
    replay: Replay,
    opts: Options,
) -> (
    tokio::task::JoinHandle<Result<ReplayStatus, String>>,
    tokio::sync::watch::Receiver<ReplayStatus>,
) {
    let (tx, rx) = tokio::sync::watch::channel(ReplayStatus::default());
    let task = tokio::spawn(async move {
        engine::run(&replay, &opts, &tx, &CancellationToken::new())
            .await
            .map_err(|e| e.to_string())
    });
    (task, rx)
}

/// Every distinct status message `rx` shows until its replay ends.
fn messages_of(
    mut rx: tokio::sync::watch::Receiver<ReplayStatus>,
) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let mut seen: Vec<String> = Vec::new();
        while rx.changed().await.is_ok() {
            let m = rx.borrow_and_update().message.clone().unwrap_or_default();
            if seen.last() != Some(&m) {
                seen.push(m);
            }
        }
        seen
    })
}

async fn ended(
    task: tokio::task::JoinHandle<Result<ReplayStatus, String>>,
    problems: &mut Vec<String>,
) -> ReplayStatus {
    match task.await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            problems.push(e);
            ReplayStatus::default()
        }
        Err(e) => {
            problems.push(format!("engine task: {e}"));
            ReplayStatus::default()
        }
    }
}

/// Fault 2a: `rabbitmqctl close_connection` on both of the replay's connections, `cuts` times
/// during a rate-limited drain; the replay reconnects and finishes.
pub async fn close_connection(
    w: &World,
    mode: &'static str,
    n: usize,
    rate: u32,
    cuts: usize,
    seed: u64,
) -> Tally {
    let task = start_drain(w, mode, n, rate, None).await;
    let at = points(seed, cuts, n);
    let mut closed = 0;
    for &point in &at {
        if !until_depth(w, &w.topo.work, point, Duration::from_secs(120)).await {
            break;
        }
        closed += close_connections(w);
    }
    let mut problems = Vec::new();
    let status = ended(task, &mut problems).await;
    if closed < cuts {
        problems.push(format!("only {closed} connections closed"));
    }
    finish(
        w,
        "rabbitmqctl close_connection",
        mode,
        n,
        1,
        &status,
        problems,
        |p, _| {
            format!(
                "{closed} connections closed at {at:?} target messages; {} OutcomeUnknown",
                p.unknown()
            )
        },
    )
    .await
}

/// Fault 2b: the whole broker goes away (`rabbitmqctl stop_app`) for `outage`, then comes back.
/// Everyone on the broker sees it: `make faults` only, never in `make test`. It stops the world's
/// broker (through its `rabbitmqctl`), but `make faults` (examples/faults.rs, `World::new`) runs
/// it on RabbitMQ 3.10 with classic queues only: not part of the matrix.
pub async fn broker_restart(
    w: &mut World,
    mode: &'static str,
    n: usize,
    rate: u32,
    outage: Duration,
) -> Tally {
    let task = start_drain(w, mode, n, rate, None).await;
    until_depth(w, &w.topo.work, n / 4, Duration::from_secs(120)).await;
    let down = Instant::now();
    {
        let _guard = BrokerDown::stop(&w.target.broker);
        tokio::time::sleep(outage).await;
    }
    let downtime = down.elapsed();
    let mut problems = Vec::new();
    let status = ended(task, &mut problems).await;
    w.reopen().await;
    finish(
        w,
        "rabbitmqctl stop_app / start_app",
        mode,
        n,
        1,
        &status,
        problems,
        |p, _| {
            format!(
                "broker down {:.1}s (stop_app to start_app done); {} OutcomeUnknown",
                downtime.as_secs_f64(),
                p.unknown()
            )
        },
    )
    .await
}

/// Stops a broker's app; starts it again when dropped (also on a panic).
struct BrokerDown(Broker);

impl BrokerDown {
    fn stop(broker: &Broker) -> Self {
        broker.must_ctl(&["stop_app"]);
        BrokerDown(broker.clone())
    }
}

impl Drop for BrokerDown {
    fn drop(&mut self) {
        let _ = self.0.ctl(&["start_app"]).output();
        let _ = self.0.ctl(&["await_startup"]).output();
    }
}

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

/// The DLQ's total (ready + unacked) on the world's broker: it drops only on an ack.
///
/// Classic: `rabbitmqctl list_queues messages`, which asks the queue. Quorum: that column comes
/// from metrics the queue emits on a timer (RabbitMQ 4.x showed 0 for a quorum DLQ holding 600
/// messages, then caught up seconds later), so the total is counted instead: ready from a
/// passive declare (answered by the queue's leader) plus the unacked deliveries on this world's
/// replay channels (`rabbitmqctl list_channels`, asked of each channel; with the canary off the
/// replay consumes from the DLQ only).
async fn dlq_total(w: &World, queue: &str) -> Option<u64> {
    if w.target.is_quorum() {
        let ready = u64::from(fixture_depth(w, queue).await?);
        let conns = replay_connections(w);
        let out = w
            .target
            .broker
            .ctl(&[
                "list_channels",
                "-q",
                "--no-table-headers",
                "connection",
                "messages_unacknowledged",
            ])
            .output()
            .ok()?;
        let unacked: u64 = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let conn = f.next()?;
                conns
                    .iter()
                    .any(|c| c == conn)
                    .then(|| f.next()?.parse::<u64>().ok())?
            })
            .sum();
        return Some(ready + unacked);
    }
    let out = w
        .target
        .broker
        .ctl(&[
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages",
        ])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let mut f = l.split_whitespace();
        (f.next() == Some(queue)).then(|| f.next()?.parse().ok())?
    })
}

/// Ready messages of `queue` (a passive declare), `None` when it cannot be asked.
async fn fixture_depth(w: &World, queue: &str) -> Option<u32> {
    crate::fixture::depth(&w.ch, queue).await.ok()
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
fn redis_retries() -> u64 {
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
fn no_unknown_after_redis_came_back(p: &Places, problems: &mut Vec<String>) {
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

/// Fault 4a: the target exchange is deleted mid-drain. Its messages fail and stay in the DLQ
/// with the reason; after the exchange is back, a second replay delivers them, each key once.
pub async fn exchange_deleted(w: &World, mode: &'static str, n: usize, rate: u32) -> Tally {
    dead_letter_n(w, n).await;
    let target = format!(
        "  target: {{exchange: \"{}\", routingKey: {}}}\n",
        w.topo.exchange,
        crate::fixture::ROUTING_KEY
    );
    let resource = w.manifest(&format!(
        "{}{target}  rate: {{messagesPerSecond: {rate}}}\n",
        w.idempotency(mode)
    ));
    let task = spawn_engine(w.replay(&resource), Options::default());
    until_depth(w, &w.topo.work, n / 3, Duration::from_secs(120)).await;
    w.ch.exchange_delete(w.topo.exchange.as_str().into(), Default::default())
        .await
        .unwrap();
    let mut problems = Vec::new();
    let first = ended(task, &mut problems).await;
    let c = first.counts;
    let in_dlq = w.depth(&w.topo.dlq).await as u64;
    // The publishes whose confirm the closed channel took with it are unknown: quarantined
    // (Claim mode) by the pass after, never counted failed and released.
    if c.failed == 0 || c.replayed + c.failed + c.quarantined != n as u64 || in_dlq != c.failed {
        problems.push(format!("first replay: {c:?}, {in_dlq} in the DLQ"));
    }
    let audit = w.audit(&first).await;
    let reasons: BTreeSet<String> = audit
        .iter()
        .filter(|r| r.decision == "failed")
        .map(|r| r.reason.split(':').next().unwrap_or_default().to_string())
        .collect();
    if reasons.iter().any(|r| r != "NoExchange") {
        problems.push(format!("failure reasons {reasons:?}"));
    }
    verify(&first, &audit, &mut problems);
    // The exchange is back: a new replay of what stayed.
    w.ch.exchange_declare(
        w.topo.exchange.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    w.ch.queue_bind(
        w.topo.work.as_str().into(),
        w.topo.exchange.as_str().into(),
        crate::fixture::ROUTING_KEY.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut again = resource.clone();
    again.metadata.name = Some(format!("{}-again", w.tag));
    let second = w.run(&again).await;
    let failed = c.failed;
    finish(w, "target exchange deleted mid-drain", mode, n, 2, &second, problems, |p, _| {
        format!(
            "1st replay: replayed {}, {} unconfirmed (quarantined), failed {failed} ({}), all {in_dlq} failed still in the DLQ; 2nd replay after re-creating it: replayed {}, {} OutcomeUnknown in all",
            c.replayed,
            c.quarantined,
            reasons.into_iter().collect::<Vec<_>>().join(","),
            second.counts.replayed,
            p.unknown()
        )
    })
    .await
}

/// Fault 4b: a target queue with `x-max-length` and `x-overflow: reject-publish` nacks what
/// does not fit: those stay in the DLQ, counted failed, with the reason.
pub async fn nacked(w: &World, mode: &'static str, n: usize, room: usize) -> Tally {
    dead_letter_n(w, n).await;
    let full = format!("{}.full", w.tag);
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(room as i32));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    w.ch.queue_declare(full.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    let status = w
        .run(&w.manifest(&format!(
            "{}  target: {{exchange: \"\", routingKey: {full}}}\n",
            w.idempotency(mode)
        )))
        .await;
    let mut problems = Vec::new();
    let c = status.counts;
    if (c.replayed, c.failed) != (room as u64, (n - room) as u64) {
        problems.push(format!("{c:?}"));
    }
    let in_dlq = w.depth(&w.topo.dlq).await as u64;
    if in_dlq != c.failed {
        problems.push(format!("{in_dlq} in the DLQ, {} failed", c.failed));
    }
    let t = finish_on(
        w,
        REDIS,
        &full,
        "target queue full (reject-publish)",
        mode,
        n,
        1,
        &status,
        &mut problems,
        |p, problems| {
            if !p.failed_reasons.iter().all(|r| r.starts_with("Nacked")) {
                problems.push(format!("reasons {:?}", p.failed_reasons.first()));
            }
            format!(
                "replayed {}, failed {} (Nacked), all failed still in the DLQ",
                c.replayed, c.failed
            )
        },
    )
    .await;
    let _ =
        w.ch.queue_delete(full.as_str().into(), Default::default())
            .await;
    t
}

/// Fault 5: poison that changes its mind: the fix did not take, the replayed jobs die again
/// with `x-replay-count`, and the next replay quarantines them (`maxDeathCount`): the loop ends.
pub async fn poison_loop(w: &World, n: usize) -> Tally {
    let mode = "-";
    dead_letter_n(w, n).await;
    let worker = w.worker(|_| true).await;
    let spec = "  poison: {maxDeathCount: 1}\n".to_string();
    let first = w.run(&w.manifest(&spec)).await;
    let mut problems = Vec::new();
    let start = Instant::now();
    while (w.depth(&w.topo.dlq).await as usize) < n && start.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = w.peek(&w.topo.dlq).await;
    if back.len() != n
        || !back
            .iter()
            .all(|m| header(m, "x-replay-count").as_deref() == Some("1"))
    {
        problems.push(format!(
            "{} came back with x-replay-count 1 of {n}",
            back.len()
        ));
    }
    worker.abort();
    let mut second = w.manifest(&spec);
    second.metadata.name = Some(format!("{}-2", w.tag));
    let status = w.run(&second).await;
    if (status.counts.quarantined, status.counts.replayed) != (n as u64, 0) {
        problems.push(format!("second replay {:?}", status.counts));
    }
    let replayed = first.counts.replayed;
    finish(
        w,
        "poison that keeps dying (2 replays)",
        mode,
        n,
        2,
        &status,
        problems,
        |p, problems| {
            if !p
                .quarantine
                .values()
                .all(|r| r.starts_with("MaxDeathCount"))
            {
                problems.push("quarantine reasons".into());
            }
            format!(
                "1st replayed {replayed}, all died again; 2nd quarantined {} MaxDeathCount",
                p.quarantine.len()
            )
        },
    )
    .await
}
