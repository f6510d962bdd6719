//! How a scenario runs the replay: `dlq-replay run` as a child process (and its `kill -9`), or the
//! engine in this process, watched, with the messages it moved found again.

use super::*;

pub(super) fn write_manifest(dir: &Path, resource: &dlq_replay_api::DlqReplay) -> PathBuf {
    let file = dir.join("replay.yaml");
    std::fs::write(&file, serde_yaml::to_string(resource).unwrap()).unwrap();
    file
}

pub(super) fn cli(bin: &Path, file: &Path, redis: &str) -> tokio::process::Command {
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

pub(super) async fn run_cli_to_end(bin: &Path, file: &Path) -> Result<ReplayStatus, String> {
    let out = cli(bin, file, redis_url())
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
        let mut child = cli(bin, &file, redis_url())
            .spawn()
            .expect("spawn dlq-replay");
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

/// Dead-letter `n` jobs and start a rate-limited replay of them in this process, its state in
/// `redis_url` (the shared Redis when `None`).
pub(super) async fn start_drain(
    w: &World,
    mode: &'static str,
    n: usize,
    rate: u32,
    redis_url: Option<&str>,
) -> tokio::task::JoinHandle<Result<ReplayStatus, String>> {
    start_watched_drain(w, mode, n, rate, redis_url).await.0
}

/// [`start_drain`], with the replay's progress to look at.
pub(super) async fn start_watched_drain(
    w: &World,
    mode: &'static str,
    n: usize,
    rate: u32,
    redis_url: Option<&str>,
) -> (
    tokio::task::JoinHandle<Result<ReplayStatus, String>>,
    tokio::sync::watch::Receiver<ReplayStatus>,
) {
    let redis_url = redis_url.unwrap_or(crate::world::redis_url());
    drain_through(w, mode, n, rate, w.amqp_url(), redis_url).await
}

/// [`start_watched_drain`] through `amqp_url` (a cluster's nodes in some order) and `redis_url`.
pub(super) async fn drain_through(
    w: &World,
    mode: &'static str,
    n: usize,
    rate: u32,
    amqp_url: &str,
    redis_url: &str,
) -> (
    tokio::task::JoinHandle<Result<ReplayStatus, String>>,
    tokio::sync::watch::Receiver<ReplayStatus>,
) {
    dead_letter_n(w, n).await;
    let resource = w.manifest(&format!(
        "{}  rate: {{messagesPerSecond: {rate}}}\n",
        w.idempotency(mode)
    ));
    let mut replay = w.replay_on(&resource, redis_url);
    replay.amqp_url = amqp_url.to_string();
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
pub(super) fn spawn_watched_engine(
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
pub(super) fn messages_of(
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

pub(super) async fn ended(
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
