//! `make bench`: throughput, rate accuracy and memory of `dlq-replay run`, against RabbitMQ's
//! own Shovel on the same dead letters. A harness, not a test: every figure goes to stdout.
//!
//! Environment: `BENCH_N` (messages per throughput run, default 50,000), `BENCH_REPS` (runs of
//! each of shovel / Check / Claim, alternating, default 3, at least 3), `BENCH_MEM=0` (skip the
//! 100,000-message memory run), `BENCH_RUN_ARGS` (extra `dlq-replay run` arguments, e.g.
//! `--window 128`), `DLQ_REPLAY_BIN` (default `target/release/dlq-replay`). `AMQP_URL`
//! and `REDIS_URL` as for the binary. An example rather than a `[[bench]]` so that it shares the
//! release profile's artifacts: `cargo run --release --example bench` builds nothing twice.
//!
//! The throughput part runs one section per broker and queue type, all alternating in one run,
//! each with its own Shovel median for "vs Shovel": `BENCH_QUEUES` (default `classic,quorum`)
//! picks the queue types on RabbitMQ 3.10 (`AMQP_URL`, its `rabbitmqctl`); `BENCH_BROKERS`
//! (default `3.10` plus `4` when RabbitMQ 4 answers at `AMQP4_URL`, default
//! amqp://guest:guest@127.0.0.1:5673/%2f, its `rabbitmqctl` being `.ci/rabbitmq4 ctl`) picks the
//! brokers. RabbitMQ 4 runs the quorum section only. The work queue, the DLQ, the quarantine
//! queue and the Shovel's destination are all of the section's type. Rate accuracy and memory
//! growth run on RabbitMQ 3.10 with classic queues, as before.
//!
//! The canary section (also classic, RabbitMQ 3.10) drains `BENCH_CANARY_N` messages (default
//! 100,000; 0 skips it) with the canary off and on, `BENCH_CANARY_REPS` times each (default 2),
//! while unrelated dead letters arrive into the DLQ at 20/s, and compares the drains' speeds.
//!
//! The redis section (classic, RabbitMQ 3.10) measures a replay's footprint in Redis: it replays
//! `BENCH_REDIS_N` messages (default 100,000; 0 skips it) in Check and Claim mode with the audit
//! in Redis, and in Check mode with `spec.audit.sink: Log`, and prints per key kind (audit,
//! settled marks, state, claims, ledger, routes) and for `INFO memory`'s `used_memory` the bytes
//! per replayed message at the peak (sampled while the replay runs) and after it ends `Done`.
//! `BENCH_SECTIONS` (default `throughput,rate,memory,redis,canary`) picks the parts to run.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use dlq_replay::engine::{self, key::key_of, store};
use dlq_replay::fixture::{self, QueueType, Topology};
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use redis::aio::ConnectionManager;
use serde_json::{json, Value};

const BODY_BYTES: usize = 1024;
/// The parts of the bench, in order; `BENCH_SECTIONS` picks some.
const ALL_SECTIONS: [&str; 5] = ["throughput", "rate", "memory", "redis", "canary"];
const NAMESPACE: &str = "bench";
/// How many idempotency keys the redis section weighs with MEMORY USAGE per sample: tens of
/// thousands of claims, each one call, would make the sampling itself the load on Redis.
const CLAIM_SAMPLE: usize = 2000;
/// The pause between two samples of a replay's Redis keys (each takes its own time on top).
const REDIS_SAMPLE_EVERY: Duration = Duration::from_millis(300);

/// What a replay run adds to the plain unbounded drain.
#[derive(Debug, Clone, Copy, Default)]
struct Extras {
    /// `rate.messagesPerSecond`.
    rate: Option<u32>,
    /// Canary on, with this `waitSeconds` (off when none).
    canary_wait: Option<u64>,
    /// Unrelated dead letters per second arriving into the DLQ during the run.
    arrivals: Option<u32>,
    /// A consumer on the target queue timestamps every arrival (always with a rate or a
    /// canary, which needs a consumer there).
    clock: bool,
    /// `spec.audit.sink: Log`: the audit rows go to the log instead of a Redis stream.
    audit_log: bool,
    /// Weigh the replay's Redis keys while it runs and after it ends (`Run::footprint`).
    footprint: bool,
}

/// A failing service's dead letters arriving into the DLQ while a replay runs: jobs published
/// at a steady rate to a queue of their own whose consumer rejects them, so they reach the DLQ
/// through the same dead-letter exchange with real `x-death` headers and their own signature.
struct Unrelated {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<u64>,
}

impl Unrelated {
    /// Stop publishing; how many were published (each rejected into the DLQ by the time this
    /// returns).
    async fn stop(self) -> u64 {
        let _ = self.stop.send(());
        self.task.await.unwrap_or(0)
    }
}

/// What one timed run measured.
#[derive(Debug, Clone)]
struct Run {
    n: usize,
    wall: f64,
    /// Peak RSS of dlq-replay in KiB (none for Shovel).
    rss_kib: Option<u64>,
    /// CPU seconds of dlq-replay (user + sys); none for Shovel.
    cpu: Option<(f64, f64)>,
    /// CPU seconds spent during the run, by the broker, Redis, this harness and the machine.
    usage: Usage,
    /// The replay's keys in Redis (with `Extras::footprint`).
    footprint: Option<Footprint>,
    /// Messages replayed (published to the target): n for Shovel and the bare client.
    replayed: u64,
    /// Redis over the run, from its own INFO: CPU seconds (used_cpu_user + used_cpu_sys) and
    /// commands executed (INFO commandstats, scripts' inner calls included, INFO itself not).
    redis_info: RedisDelta,
    /// Allocations of the process (a binary built with `--features count-allocs` prints them
    /// at exit), none otherwise.
    allocs: Option<u64>,
}

/// Redis's own counters over a run (INFO cpu, INFO commandstats).
#[derive(Debug, Clone, Default)]
struct RedisDelta {
    cpu: f64,
    calls: u64,
    /// Calls per command, largest first.
    by_command: Vec<(String, u64)>,
}

/// Redis's counters now: CPU seconds and calls per command (INFO's own calls left out).
async fn redis_counters(
    con: &mut ConnectionManager,
) -> (f64, std::collections::BTreeMap<String, u64>) {
    let cpu_info = redis_info(con, "cpu").await;
    let f = |n: &str| {
        info_field(&cpu_info, n)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let cpu = f("used_cpu_user") + f("used_cpu_sys");
    let stats = redis_info(con, "commandstats").await;
    let mut calls = std::collections::BTreeMap::new();
    for line in stats.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        if name == "info" {
            continue;
        }
        let n = rest
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        calls.insert(name.to_string(), n);
    }
    (cpu, calls)
}

fn redis_delta(
    before: &(f64, std::collections::BTreeMap<String, u64>),
    after: &(f64, std::collections::BTreeMap<String, u64>),
) -> RedisDelta {
    let mut by_command: Vec<(String, u64)> = after
        .1
        .iter()
        .map(|(k, v)| (k.clone(), v.saturating_sub(*before.1.get(k).unwrap_or(&0))))
        .filter(|(_, v)| *v > 0)
        .collect();
    by_command.sort_by_key(|c| std::cmp::Reverse(c.1));
    RedisDelta {
        cpu: (after.0 - before.0).max(0.0),
        calls: by_command.iter().map(|(_, v)| v).sum(),
        by_command,
    }
}

/// The allocation count a `count-allocs` build prints at exit, from its stderr.
fn parse_allocs(stderr: &[u8]) -> Option<u64> {
    String::from_utf8_lossy(stderr).lines().find_map(|l| {
        l.strip_prefix("count-allocs: allocations=")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// CPU seconds so far (a snapshot) or over a run (a difference of two).
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    broker: f64,
    redis: f64,
    harness: f64,
    /// All cores, every process: user + nice + system + irq + softirq + steal.
    busy: f64,
    iowait: f64,
}

impl std::ops::Sub for Usage {
    type Output = Usage;
    fn sub(self, o: Usage) -> Usage {
        Usage {
            broker: self.broker - o.broker,
            redis: self.redis - o.redis,
            harness: self.harness - o.harness,
            busy: self.busy - o.busy,
            iowait: self.iowait - o.iowait,
        }
    }
}

impl Run {
    /// CPU microseconds per DLQ message of the process measured (dlq-replay, or this harness
    /// for the bare client), none for Shovel (it runs inside the broker).
    fn own_us(&self) -> Option<f64> {
        self.cpu.map(|(u, s)| (u + s) * 1e6 / self.n as f64)
    }

    fn broker_us(&self) -> f64 {
        self.usage.broker * 1e6 / self.n as f64
    }

    /// Redis CPU per DLQ message, from Redis's INFO cpu.
    fn redis_us(&self) -> f64 {
        self.redis_info.cpu * 1e6 / self.n as f64
    }

    /// Redis commands per replayed message.
    fn redis_calls(&self) -> f64 {
        self.redis_info.calls as f64 / self.replayed.max(1) as f64
    }

    fn allocs_per(&self) -> Option<f64> {
        self.allocs.map(|a| a as f64 / self.replayed.max(1) as f64)
    }

    fn cost_text(&self) -> String {
        let top: Vec<String> = self
            .redis_info
            .by_command
            .iter()
            .take(8)
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        format!(
            "per message: own {} us, broker {:.1} us, Redis {:.1} us CPU; Redis {:.2} commands per replayed message ({}){}",
            self.own_us().map(|u| format!("{u:.1}")).unwrap_or_else(|| "-".into()),
            self.broker_us(),
            self.redis_us(),
            self.redis_calls(),
            top.join(", "),
            self.allocs_per()
                .map(|a| format!("; {a:.1} allocations per replayed message ({} in all)", self.allocs.unwrap_or(0)))
                .unwrap_or_default()
        )
    }

    fn rate(&self) -> f64 {
        self.n as f64 / self.wall
    }

    /// CPU seconds of processes other than dlq-replay, the broker, Redis and this harness
    /// (another build or test suite on the machine makes the figures noisy).
    fn other(&self) -> f64 {
        let own = self.cpu.map(|(u, s)| u + s).unwrap_or(0.0);
        let u = &self.usage;
        (u.busy - u.broker - u.redis - u.harness - own).max(0.0)
    }

    fn machine_text(&self) -> String {
        format!(
            "machine {:.2} of {} cores busy, other processes {:.2} CPU/s, iowait {:.2}",
            self.usage.busy / self.wall,
            nproc(),
            self.other() / self.wall,
            self.usage.iowait / self.wall
        )
    }
}

/// A RabbitMQ the bench runs against.
struct Broker {
    /// `3.10` or `4`, as BENCH_BROKERS names it; in labels.
    name: &'static str,
    amqp: String,
    conn: Connection,
    /// The program and leading arguments that make its `rabbitmqctl`.
    ctl: Vec<String>,
    /// The URI the Shovel (inside the broker) connects to, for its source and destination.
    shovel_uri: String,
    /// The RabbitMQ node (beam.smp), for its CPU time.
    pid: Option<u32>,
    version: String,
}

impl Broker {
    /// `rabbitmqctl ARGS` of this broker, to spawn.
    fn ctl(&self, args: &[&str]) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(&self.ctl[0]);
        c.args(&self.ctl[1..]).args(args);
        c
    }

    /// `rabbitmqctl ARGS` run to its end: its stdout (empty if it failed to start).
    fn ctl_out(&self, args: &[&str]) -> String {
        let all: Vec<&str> = self.ctl[1..]
            .iter()
            .map(String::as_str)
            .chain(args.iter().copied())
            .collect();
        cmd_out(&self.ctl[0], &all)
    }
}

/// One throughput section: a broker and the type of every queue of its runs.
#[derive(Debug, Clone)]
struct Section {
    /// Index into `Bench::brokers`.
    broker: usize,
    queue_type: QueueType,
    /// e.g. `quorum DLQ (RabbitMQ 3.10)`.
    label: String,
    /// Prepended to scenario names (empty for classic on 3.10, which keeps its old names).
    tag: String,
}

impl Section {
    /// RabbitMQ 3.10, classic queues: the rate-accuracy and memory runs.
    fn classic_3_10() -> Self {
        Section::new(0, "3.10", QueueType::Classic)
    }

    fn new(broker: usize, broker_name: &str, queue_type: QueueType) -> Self {
        let tag = if broker == 0 && queue_type == QueueType::Classic {
            String::new()
        } else {
            let q = match queue_type {
                QueueType::Classic => 'c',
                QueueType::Quorum => 'q',
            };
            format!("{q}{}-", broker_name.split('.').next().unwrap_or("x"))
        };
        Section {
            broker,
            queue_type,
            label: format!("{queue_type} DLQ (RabbitMQ {broker_name})"),
            tag,
        }
    }

    /// `, quorum DLQ (RabbitMQ 3.10)` in progress lines, nothing for the classic 3.10 runs.
    fn note(&self) -> String {
        if self.tag.is_empty() {
            String::new()
        } else {
            format!(", {}", self.label)
        }
    }
}

struct Bench {
    redis_url: String,
    bin: PathBuf,
    run_id: String,
    /// RabbitMQ 3.10 first (always: rate accuracy and memory run there), then RabbitMQ 4 when
    /// BENCH_BROKERS asks for it and it answers.
    brokers: Vec<Broker>,
    choice: BrokerChoice,
    redis: ConnectionManager,
    time_rss: bool,
    /// Extra arguments of `dlq-replay run`, from BENCH_RUN_ARGS (e.g. `--window 128`).
    run_args: Vec<String>,
    redis_pid: Option<u32>,
    clk_tck: f64,
    problems: Vec<String>,
    tmp: tempfile::TempDir,
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if cfg!(debug_assertions) {
        eprintln!("bench: build it with --release (run `make bench`)");
        std::process::exit(2);
    }
    let n = env_usize("BENCH_N", 50_000);
    // At least 3 (medians), but for a run of chosen rows (BENCH_ROWS: a profiler's, say).
    let reps = env_usize("BENCH_REPS", 3).max(if std::env::var_os("BENCH_ROWS").is_some() {
        1
    } else {
        3
    });
    let mem = std::env::var("BENCH_MEM").map(|v| v != "0").unwrap_or(true);
    let queues = env_queues();
    let sections_wanted =
        std::env::var("BENCH_SECTIONS").unwrap_or_else(|_| ALL_SECTIONS.join(","));
    let sections_wanted: Vec<&str> = ALL_SECTIONS
        .iter()
        .copied()
        .filter(|s| sections_wanted.split(',').any(|w| w.trim() == *s))
        .collect();
    let mut b = Bench::new().await;
    let sections = b.sections(&queues);
    header(&b, &args, n, reps, mem, &sections).await;
    for broker in &b.brokers {
        enable_shovel(broker);
    }

    if sections_wanted.contains(&"throughput") {
        // Throughput: shovel, Check, Claim, alternating, section after section within each round.
        let mut shovel = vec![Vec::new(); sections.len()];
        let mut check = vec![Vec::new(); sections.len()];
        let mut claim = vec![Vec::new(); sections.len()];
        let mut bare = vec![Vec::new(); sections.len()];
        let window = b.window();
        // BENCH_ROWS picks the rows (default all): e.g. `check,claim` with a count-allocs or a
        // BENCH_WRAP'd (callgrind) binary.
        let rows_env =
            std::env::var("BENCH_ROWS").unwrap_or_else(|_| "shovel,bare,check,claim".into());
        let rows: Vec<&str> = rows_env.split(',').map(str::trim).collect();
        println!(
            "\n== throughput: N = {n} messages of ~{BODY_BYTES} B JSON, {reps} runs each, alternating; sections: {}",
            sections
                .iter()
                .map(|s| s.label.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        for rep in 1..=reps {
            for (i, s) in sections.iter().enumerate() {
                let t = &s.tag;
                if rows.contains(&"shovel") {
                    shovel[i].push(b.shovel(s, rep, n).await);
                }
                if rows.contains(&"bare") {
                    bare[i].push(b.bare(s, rep, n, window).await);
                }
                if rows.contains(&"check") {
                    check[i].push(
                        b.replay(s, &format!("{t}check{rep}"), n, "Check", Extras::default())
                            .await
                            .0,
                    );
                }
                if rows.contains(&"claim") {
                    claim[i].push(
                        b.replay(s, &format!("{t}claim{rep}"), n, "Claim", Extras::default())
                            .await
                            .0,
                    );
                }
            }
        }
        println!(
            "\n== throughput table (N = {n}; msg/s = N / wall; dlq-replay: 10 % duplicates in Redis, audit on, canary off, no rate limit; vs Shovel: against the Shovel median of the same broker and queue type)"
        );
        println!(
            "{:<19} {:>4} {:>12} {:>13} {:>11} {:>9} {:>14} {:>14} {:>10} {:>12} {:>11}",
            "scenario",
            "runs",
            "median msg/s",
            "min-max msg/s",
            "median wall",
            "vs Shovel",
            "peak RSS (med)",
            "RSS min-max",
            "proc CPU/s",
            "broker CPU/s",
            "other CPU/s"
        );
        if sections.is_empty() {
            println!("(no throughput section: BENCH_QUEUES and BENCH_BROKERS select none)");
        }
        for (i, s) in sections.iter().enumerate() {
            println!("{}:", s.label);
            let shovel_median = median(shovel[i].iter().map(Run::rate));
            for (name, runs) in [
                ("shovel (on-confirm)", &shovel[i]),
                ("bare client", &bare[i]),
                ("dlq-replay Check", &check[i]),
                ("dlq-replay Claim", &claim[i]),
            ] {
                table_row(name, runs, shovel_median);
            }
        }
        println!(
            "\n== cost per message (medians; CPU us per DLQ message; Redis: its own INFO cpu and commandstats, commands per replayed message; allocations per replayed message when the binary was built with --features count-allocs; bare client: consume (prefetch as dlq-replay), publish with at most {window} unconfirmed, ack the oldest half-window with one multiple ack once confirmed, in this harness)"
        );
        println!(
            "{:<19} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9}",
            "scenario",
            "own us",
            "broker us",
            "Redis us",
            "Redis cmd",
            "allocs",
            "msg/s",
            "vs Shovel",
            "vs bare"
        );
        for (i, s) in sections.iter().enumerate() {
            println!("{}:", s.label);
            let shovel_median = median(shovel[i].iter().map(Run::rate));
            let bare_median = median(bare[i].iter().map(Run::rate));
            for (name, runs) in [
                ("shovel (on-confirm)", &shovel[i]),
                ("bare client", &bare[i]),
                ("dlq-replay Check", &check[i]),
                ("dlq-replay Claim", &claim[i]),
            ] {
                cost_row(name, runs, shovel_median, bare_median);
            }
        }
        println!("  proc CPU/s: dlq-replay's (user+sys) CPU seconds per wall second (1.0 = one core busy); broker CPU/s: the same for the RabbitMQ node (beam.smp) of the section; other CPU/s: the machine's busy time (/proc/stat) less dlq-replay, that broker, Redis and this harness, floored at 0: other work on the machine, i.e. noise (approximate; another broker's idle load counts there); the machine has {} cores.", nproc());
        for (i, s) in sections.iter().enumerate() {
            for (name, runs) in [
                ("dlq-replay Check", &check[i]),
                ("dlq-replay Claim", &claim[i]),
            ] {
                let user = median(runs.iter().filter_map(|r| r.cpu.map(|c| c.0 / r.wall)));
                let sys = median(runs.iter().filter_map(|r| r.cpu.map(|c| c.1 / r.wall)));
                let redis = median(runs.iter().map(|r| r.usage.redis / r.wall));
                let us = median(
                    runs.iter()
                        .filter_map(|r| r.cpu.map(|c| (c.0 + c.1) * 1e6 / r.n as f64)),
                );
                println!(
                    "  {}, {name}: median user {user:.2} + sys {sys:.2} CPU/s, {us:.0} us CPU per message; Redis {redis:.2} CPU/s",
                    s.label
                );
            }
            let shovel_redis = median(shovel[i].iter().map(|r| r.usage.redis / r.wall));
            println!(
                "  {}, shovel: Redis {shovel_redis:.2} CPU/s (idle, as expected)",
                s.label
            );
        }
    } else {
        println!("\n== throughput: skipped (BENCH_SECTIONS)");
    }

    if sections_wanted.contains(&"rate") {
        // Rate accuracy.
        println!("\n== rate accuracy (arrival times on the target queue, from a consumer started before the replay)");
        let mut rows = Vec::new();
        for (count, limit) in [(5_000usize, 500u32), (1_000, 50)] {
            rows.push(b.rate(count, limit).await);
        }
        println!(
            "{:<8} {:>6} {:>14} {:>18} {:>16} {:>20} {:>11} {:>13}",
            "limit",
            "msgs",
            "achieved msg/s",
            "worst 1-s window",
            "first 1-s window",
            "worst after first 1s",
            "drain time",
            "process wall"
        );
        for row in rows {
            println!("{row}");
        }
        println!("  achieved = (arrivals - 1) / (last arrival - first arrival); a 1-s window is [t, t+1s) for every arrival t; the worst is the one with most arrivals (percent over the limit in brackets)");
    } else {
        println!("\n== rate: skipped (BENCH_SECTIONS)");
    }

    if sections_wanted.contains(&"memory") {
        // Memory growth.
        println!("\n== memory growth (Check mode, same setup as the throughput runs)");
        let base = Section::classic_3_10();
        let small = b
            .replay(&base, "mem10k", 10_000, "Check", Extras::default())
            .await
            .0;
        let big = if mem {
            Some(
                b.replay(&base, "mem100k", 100_000, "Check", Extras::default())
                    .await
                    .0,
            )
        } else {
            println!("  N = 100000 skipped (BENCH_MEM=0)");
            None
        };
        println!(
            "{:<10} {:>14} {:>12} {:>10}",
            "N", "peak RSS", "wall", "msg/s"
        );
        for r in std::iter::once(&small).chain(big.as_ref()) {
            println!(
                "{:<10} {:>14} {:>11.2}s {:>10.0}",
                r.n,
                rss_text(r.rss_kib),
                r.wall,
                r.rate()
            );
        }
        if let (Some(big), Some(a), Some(z)) =
            (&big, small.rss_kib, big.as_ref().and_then(|r| r.rss_kib))
        {
            println!(
                "  ratio 100k/10k: {:.2}x peak RSS for {}x messages ({:.1} KiB per extra message)",
                z as f64 / a as f64,
                big.n / small.n,
                (z as f64 - a as f64) / (big.n - small.n) as f64
            );
        }
    } else {
        println!("\n== memory: skipped (BENCH_SECTIONS)");
    }

    if sections_wanted.contains(&"redis") {
        let redis_n = env_usize("BENCH_REDIS_N", 100_000);
        if redis_n == 0 {
            println!("\n== redis footprint: skipped (BENCH_REDIS_N=0)");
        } else {
            redis_section(&mut b, redis_n).await;
        }
    } else {
        println!("\n== redis: skipped (BENCH_SECTIONS)");
    }

    if sections_wanted.contains(&"canary") {
        // Canary with arrivals: the drain's speed with the canary on (its return watch running)
        // against the same drain with it off, while another service's dead letters keep arriving.
        let canary_n = env_usize("BENCH_CANARY_N", 100_000);
        if canary_n == 0 {
            println!("\n== canary with arrivals: skipped (BENCH_CANARY_N=0)");
        } else {
            canary_section(&mut b, canary_n, env_usize("BENCH_CANARY_REPS", 2).max(1)).await;
        }
    } else {
        println!("\n== canary: skipped (BENCH_SECTIONS)");
    }

    if b.problems.is_empty() {
        println!("\nall runs checked: every message accounted for");
    } else {
        println!("\nPROBLEMS:");
        for p in &b.problems {
            println!("  - {p}");
        }
        std::process::exit(1);
    }
}

async fn canary_section(b: &mut Bench, n: usize, reps: usize) {
    // The canary's `waitSeconds` (default the least the spec allows).
    let wait = env_usize("BENCH_CANARY_WAIT", 5) as u64;
    // Unrelated dead letters per second (0: none).
    let per_s = env_usize("BENCH_CANARY_ARRIVALS", 20) as u32;
    println!(
        "\n== canary with arrivals (classic DLQ, RabbitMQ 3.10; N = {n}, 10 % duplicates, Check; {per_s}/s unrelated dead letters (another queue's, own signature) arriving into the DLQ during the whole run; canary off vs on (waitSeconds {wait}), alternating, {reps} runs each)"
    );
    let base = Section::classic_3_10();
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for rep in 1..=reps {
        for (canary, runs) in [(None, &mut off), (Some(wait), &mut on)] {
            let scenario = format!("canary{}{rep}", if canary.is_some() { "on" } else { "off" });
            let extras = Extras {
                canary_wait: canary,
                arrivals: (per_s > 0).then_some(per_s),
                // Off as on: the same consumer on the target, so the drains compare.
                clock: true,
                ..Default::default()
            };
            let (run, arrivals) = b.replay(&base, &scenario, n, "Check", extras).await;
            runs.push((run, arrivals));
        }
    }
    // The drain's own speed: the replayed messages' arrivals on the target after the first
    // (the canary, when on), over their span.
    let drain_rate = |a: &[f64]| match a {
        [_, second, .., last] if last > second => (a.len() - 2) as f64 / (last - second),
        _ => 0.0,
    };
    let off_rate = median(off.iter().map(|(_, a)| drain_rate(a)));
    println!(
        "{:<12} {:>4} {:>17} {:>15} {:>15} {:>12} {:>23}",
        "canary",
        "runs",
        "drain msg/s (med)",
        "min-max",
        "vs canary off",
        "median wall",
        "first drained at (med)"
    );
    for (label, runs) in [("off", &off), ("on", &on)] {
        let rates: Vec<f64> = runs.iter().map(|(_, a)| drain_rate(a)).collect();
        let rate = median(rates.iter().copied());
        let (lo, hi) = rates
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        let first = median(runs.iter().filter_map(|(_, a)| a.get(1).copied()));
        println!(
            "{label:<12} {:>4} {rate:>17.0} {:>15} {:>14.2}x {:>11.2}s {:>22.2}s",
            runs.len(),
            format!("{lo:.0}-{hi:.0}"),
            rate / off_rate,
            median(runs.iter().map(|(r, _)| r.wall)),
            first
        );
    }
    println!("  drain msg/s = (replayed arrivals on the target after the first - 1) / their time span, from a consumer started before the replay; first drained at = seconds from the process start to the second arrival (with the canary on: after the selection pass over the whole DLQ and the wait)");
}

/// A replay's footprint in Redis, by key kind: Check and Claim with the audit in Redis, Check
/// with the audit sent to the log.
async fn redis_section(b: &mut Bench, n: usize) {
    let server = redis_info(&mut b.redis, "server").await;
    let policy: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut b.redis)
        .await
        .unwrap_or_default();
    println!(
        "\n== redis footprint (classic DLQ, RabbitMQ 3.10; N = {n}, 10 % duplicates whose keys the bench marked done beforehand (not counted); canary off; Redis {}, maxmemory-policy {})",
        info_field(&server, "redis_version").unwrap_or("?"),
        policy.get(1).map(String::as_str).unwrap_or("?")
    );
    println!("  B/msg = bytes / replayed messages. Per kind: MEMORY USAGE <key> SAMPLES 0 of the replay's keys (audit: dlq:audit:{NAMESPACE}/<name>/*; settled: dlq:settled:{NAMESPACE}/<name>/*; state: dlq:replay:{NAMESPACE}/<name>; claims: the idempotency keys holding a claim, not the done marks; ledger and routes: dlq:moves:*, dlq:routes:* of the DLQ); used_memory: INFO memory, minus its value just before the replay started. Peak: the largest figure over samples every ~{} ms (plus the sample's own time) while the replay runs and the one after it ends; total's peak is the largest sum within one sample. After Done: once the process exited.", REDIS_SAMPLE_EVERY.as_millis());
    let base = Section::classic_3_10();
    for (label, scenario, mode, audit_log) in [
        ("Check, audit in Redis", "redischeck", "Check", false),
        ("Claim, audit in Redis", "redisclaim", "Claim", false),
        ("Check, audit to the log", "redislog", "Check", true),
    ] {
        let extras = Extras {
            audit_log,
            footprint: true,
            ..Default::default()
        };
        // Before building a DLQ for it: a binary older than `spec.audit.sink` refuses it.
        if audit_log {
            if let Err(why) = b.accepts(&base, scenario, mode, extras).await {
                println!("{label}: not supported by this binary ({why})");
                continue;
            }
        }
        let (run, _) = b.replay(&base, scenario, n, mode, extras).await;
        match &run.footprint {
            Some(f) => print_footprint(label, f),
            None => println!("{label}: no Redis figures (see PROBLEMS)"),
        }
    }
}

/// One row of the redis section: its table of bytes per replayed message.
fn print_footprint(label: &str, f: &Footprint) {
    let (peak, after) = (&f.sampled.peak, &f.after);
    // Per message of the DLQ too (duplicates included: they have audit rows and settled
    // marks of their own), to compare with figures taken on a DLQ without duplicates.
    println!(
        "{label}: replayed {}, duplicates {}; {} samples; after Done {:.1} MiB in the replay's keys ({:.0} B per DLQ message), used_memory {:+.1} MiB",
        f.replayed,
        f.duplicates,
        f.sampled.samples,
        after.total() / 1048576.0,
        after.total() / (f.replayed + f.duplicates).max(1) as f64,
        (after.used_memory - f.before) / 1048576.0
    );
    let per = |bytes: f64| bytes / f.replayed.max(1) as f64;
    println!(
        "  {:<14} {:>11} {:>17} {:>15}",
        "kind", "peak B/msg", "after Done B/msg", "after Done B"
    );
    let estimated = peak.claims_estimated || after.claims_estimated;
    let claims = if estimated { "claims (est.)" } else { "claims" };
    let mut rows = vec![
        ("audit", peak.audit, after.audit),
        ("settled", peak.settled, after.settled),
        ("state", peak.state, after.state),
        (claims, peak.claims, after.claims),
        ("ledger", peak.ledger, after.ledger),
        ("routes", peak.routes, after.routes),
    ];
    // Keys under the run's names that are none of the kinds: none expected, shown if any.
    if peak.other > 0.0 {
        rows.push(("other", peak.other, after.other));
    }
    rows.push(("total", f.sampled.peak_total, after.total()));
    rows.push((
        "used_memory",
        peak.used_memory - f.before,
        after.used_memory - f.before,
    ));
    for (kind, p, a) in rows {
        println!("  {kind:<14} {:>11.1} {:>17.1} {a:>15.0}", per(p), per(a));
    }
    if estimated {
        println!("  claims (est.): MEMORY USAGE of a random sample of {CLAIM_SAMPLE} of the keys under the idempotency prefix (done marks included, counting for nothing), times their count over {CLAIM_SAMPLE}");
    }
}

/// The names of a replay's keys in Redis, by kind (`ns` being NAMESPACE and `name` the
/// replay's, as `Replay::state_name()` makes it for the CLI: metadata.name).
#[derive(Debug, Clone)]
struct ReplayKeys {
    /// What all of them contain: the replay's name, which its queues' names and its
    /// idempotency prefix start with too.
    name: String,
    /// `dlq:replay:<ns>/<name>`, a hash.
    state: String,
    /// `dlq:audit:<ns>/<name>/`: its streams (and anything the stream keeps beside it) start so.
    audit: String,
    /// `dlq:settled:<ns>/<name>/`, a hash per replay id.
    settled: String,
    /// The idempotency prefix: the claims and the done marks, `<prefix><32 hex>`.
    idem: String,
    /// The ledger (`dlq:moves:<broker>/<queue>`) and the routes (`dlq:routes:...`) of the DLQ
    /// end with `/<dlq>`.
    dlq_suffix: String,
}

impl ReplayKeys {
    fn new(name: &str, idem: &str, dlq: &str) -> Self {
        ReplayKeys {
            name: name.into(),
            state: store::Keys::state_of(NAMESPACE, name),
            audit: store::Keys::audit_of(NAMESPACE, name, ""),
            settled: format!("dlq:settled:{NAMESPACE}/{name}/"),
            idem: idem.into(),
            dlq_suffix: format!("/{dlq}"),
        }
    }

    /// An idempotency key, `<prefix><32 hex>`: a claim or a done mark.
    fn is_idem(&self, key: &str) -> bool {
        key.strip_prefix(&self.idem)
            .is_some_and(|h| h.len() == 32 && h.bytes().all(|c| c.is_ascii_hexdigit()))
    }
}

/// A replay's keys in Redis at one moment, in bytes by kind, with Redis's used_memory.
#[derive(Debug, Clone, Copy, Default)]
struct RedisBytes {
    audit: f64,
    settled: f64,
    state: f64,
    claims: f64,
    ledger: f64,
    routes: f64,
    /// Keys with the replay's name in them that are none of the above.
    other: f64,
    /// `INFO memory` used_memory.
    used_memory: f64,
    /// The claims were weighed on a sample (more idempotency keys than CLAIM_SAMPLE) that
    /// held some.
    claims_estimated: bool,
}

impl RedisBytes {
    /// The figure a key of the replay other than an idempotency key counts in.
    fn kind(&mut self, k: &ReplayKeys, key: &str) -> &mut f64 {
        if key == k.state {
            &mut self.state
        } else if key.starts_with(&k.audit) {
            &mut self.audit
        } else if key.starts_with(&k.settled) {
            &mut self.settled
        } else if key.starts_with("dlq:moves:") && key.ends_with(&k.dlq_suffix) {
            &mut self.ledger
        } else if key.starts_with("dlq:routes:") && key.ends_with(&k.dlq_suffix) {
            &mut self.routes
        } else {
            &mut self.other
        }
    }

    fn total(&self) -> f64 {
        self.audit
            + self.settled
            + self.state
            + self.claims
            + self.ledger
            + self.routes
            + self.other
    }
}

/// The samples of one replay: each figure's largest.
#[derive(Debug, Clone, Copy, Default)]
struct Sampled {
    /// Per kind and for used_memory, the largest of any sample.
    peak: RedisBytes,
    /// The largest total of one sample (the kinds peak at different moments).
    peak_total: f64,
    samples: usize,
}

impl Sampled {
    fn add(&mut self, b: &RedisBytes) {
        let p = &mut self.peak;
        for (peak, v) in [
            (&mut p.audit, b.audit),
            (&mut p.settled, b.settled),
            (&mut p.state, b.state),
            (&mut p.claims, b.claims),
            (&mut p.ledger, b.ledger),
            (&mut p.routes, b.routes),
            (&mut p.other, b.other),
            (&mut p.used_memory, b.used_memory),
        ] {
            *peak = peak.max(v);
        }
        p.claims_estimated |= b.claims_estimated;
        self.peak_total = self.peak_total.max(b.total());
        self.samples += 1;
    }
}

/// What the redis section measured of one replay.
#[derive(Debug, Clone, Copy)]
struct Footprint {
    replayed: u64,
    duplicates: u64,
    /// used_memory just before the replay started.
    before: f64,
    /// While it ran, and the sample after it ended.
    sampled: Sampled,
    /// Once the process exited, `Done`.
    after: RedisBytes,
}

/// Sample the replay's keys until `stop`; the largest figures seen.
async fn sample_redis(
    mut con: ConnectionManager,
    keys: ReplayKeys,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Sampled {
    let mut sampled = Sampled::default();
    loop {
        sampled.add(&redis_bytes(&mut con, &keys).await);
        tokio::select! {
            _ = tokio::time::sleep(REDIS_SAMPLE_EVERY) => {}
            _ = &mut stop => return sampled,
        }
    }
}

/// The replay's keys now, by kind.
async fn redis_bytes(con: &mut ConnectionManager, k: &ReplayKeys) -> RedisBytes {
    // First, so that the replies to this sample's own SCAN are not in it.
    let used_memory = used_memory(&redis_info(con, "memory").await);
    let mut b = RedisBytes {
        used_memory,
        ..Default::default()
    };
    // One pass over the keyspace: every key of the replay has its name in it.
    let (idem_keys, exact): (Vec<String>, Vec<String>) = scan(con, &format!("*{}*", k.name))
        .await
        .into_iter()
        .partition(|key| k.is_idem(key));
    // None yet, before the replay wrote its first (an empty pipeline is an error).
    if !exact.is_empty() {
        let mut p = redis::pipe();
        for key in &exact {
            p.cmd("MEMORY").arg("USAGE").arg(key).arg("SAMPLES").arg(0);
        }
        // A key gone since the SCAN (an expiry, the end of the replay) weighs nothing.
        let sizes: Vec<Option<u64>> = p.query_async(con).await.expect("MEMORY USAGE");
        for (key, size) in exact.iter().zip(sizes) {
            *b.kind(k, key) += size.unwrap_or(0) as f64;
        }
    }
    // The claims: the idempotency keys whose value is a replay's claim (the done marks the
    // bench set are the workers', not the replay's), weighed on a random sample.
    let sample: Vec<&String> = if idem_keys.len() <= CLAIM_SAMPLE {
        idem_keys.iter().collect()
    } else {
        rand::seq::index::sample(&mut rand::rng(), idem_keys.len(), CLAIM_SAMPLE)
            .into_iter()
            .map(|i| &idem_keys[i])
            .collect()
    };
    if !sample.is_empty() {
        let mut p = redis::pipe();
        for key in &sample {
            p.cmd("GET").arg(*key);
            p.cmd("MEMORY").arg("USAGE").arg(*key).arg("SAMPLES").arg(0);
        }
        let answers: Vec<(Option<String>, Option<u64>)> =
            p.query_async(con).await.expect("GET, MEMORY USAGE");
        let claims: f64 = answers
            .iter()
            .filter(|(value, _)| {
                matches!(
                    store::Held::of(value.as_deref(), "done"),
                    store::Held::Published(_) | store::Held::Unconfirmed(_)
                )
            })
            .map(|(_, size)| size.unwrap_or(0) as f64)
            // Not sum(): that of no claims is -0.0.
            .fold(0.0, |all, size| all + size);
        b.claims = claims * idem_keys.len() as f64 / sample.len() as f64;
        // No claim in the sample (Check mode: only done marks) says none, not an estimate.
        b.claims_estimated = sample.len() < idem_keys.len() && claims > 0.0;
    }
    b
}

/// Every key matching `pattern`.
async fn scan(con: &mut ConnectionManager, pattern: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(5000)
            .query_async(con)
            .await
            .expect("SCAN");
        out.extend(keys);
        if next == 0 {
            return out;
        }
        cursor = next;
    }
}

/// `INFO <section>` of Redis (empty if it fails).
async fn redis_info(con: &mut ConnectionManager, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query_async(con)
        .await
        .unwrap_or_default()
}

/// A field's value in an `INFO` reply.
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

fn used_memory(info: &str) -> f64 {
    info_field(info, "used_memory")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// used_memory once Redis has freed what UNLINK left to its background thread (the keys of
/// the runs before), so that it does not count against the next.
async fn used_memory_settled(con: &mut ConnectionManager) -> f64 {
    for _ in 0..100 {
        let info = redis_info(con, "memory").await;
        if info_field(&info, "lazyfree_pending_objects") == Some("0") {
            return used_memory(&info);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    used_memory(&redis_info(con, "memory").await)
}

impl Bench {
    async fn new() -> Self {
        let amqp = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let redis_url =
            std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        let conn = engine::connect_amqp(&amqp, "dlq-replay bench")
            .await
            .expect("broker");
        let mut v3 = Broker {
            name: "3.10",
            amqp,
            conn,
            ctl: vec!["rabbitmqctl".into()],
            shovel_uri: "amqp://guest:guest@127.0.0.1".into(),
            pid: None,
            version: String::new(),
        };
        v3.version = v3.ctl_out(&["-q", "version"]).trim().to_string();
        v3.pid = node_pid(&v3).or_else(|| oldest_process("beam.smp"));
        let mut brokers = vec![v3];
        let choice = env_brokers();
        if choice.v4 {
            match Broker::v4().await {
                Ok(b) => brokers.push(b),
                Err(why) if choice.v4_required => {
                    eprintln!("bench: BENCH_BROKERS asks for RabbitMQ 4 but {why}");
                    std::process::exit(2);
                }
                Err(why) => println!("RabbitMQ 4: skipped, {why} (run .ci/rabbitmq4)"),
            }
        }
        let redis = store::connect(&redis_url).await.expect("redis");
        let bin = std::env::var_os("DLQ_REPLAY_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let target = std::env::var_os("CARGO_TARGET_DIR")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
                target.join("release").join("dlq-replay")
            });
        assert!(
            bin.exists(),
            "{} is missing: cargo build --release",
            bin.display()
        );
        let tmp = tempfile::tempdir().expect("tempdir");
        let time_rss = time_works(tmp.path());
        let redis_pid = oldest_process("redis-server");
        let clk_tck = cmd_out("getconf", &["CLK_TCK"])
            .trim()
            .parse()
            .unwrap_or(100.0);
        Self {
            redis_url,
            bin,
            run_id: uuid::Uuid::new_v4().simple().to_string()[..6].to_string(),
            brokers,
            choice,
            redis,
            time_rss,
            run_args: std::env::var("BENCH_RUN_ARGS")
                .unwrap_or_default()
                .split_whitespace()
                .map(String::from)
                .collect(),
            redis_pid,
            clk_tck,
            problems: Vec::new(),
            tmp,
        }
    }

    /// The throughput sections: RabbitMQ 3.10 with each of `queues`, then RabbitMQ 4 (when
    /// there) with quorum queues if `queues` has them.
    fn sections(&self, queues: &[QueueType]) -> Vec<Section> {
        let mut out = Vec::new();
        for (i, broker) in self.brokers.iter().enumerate() {
            for &q in queues {
                // BENCH_BROKERS=4 leaves RabbitMQ 3.10 connected (rate accuracy and memory run
                // there) but without a throughput section.
                let run = match i {
                    0 => self.choice.v3,
                    _ => q == QueueType::Quorum,
                };
                if run {
                    out.push(Section::new(i, broker.name, q));
                }
            }
        }
        out
    }

    fn prefix(&self, scenario: &str) -> String {
        format!("bench-{}-{scenario}", self.run_id)
    }

    async fn channel(&self, s: &Section) -> Channel {
        self.brokers[s.broker]
            .conn
            .create_channel()
            .await
            .expect("channel")
    }

    /// CPU counters now, the broker's being that of section `s`.
    fn cpu(&self, s: &Section) -> Usage {
        let t = |pid: Option<u32>| pid.map(|p| proc_cpu(p) / self.clk_tck).unwrap_or(0.0);
        let (busy, iowait) = machine_cpu();
        Usage {
            broker: t(self.brokers[s.broker].pid),
            redis: t(self.redis_pid),
            harness: t(Some(std::process::id())),
            busy: busy / self.clk_tck,
            iowait: iowait / self.clk_tck,
        }
    }

    /// A fresh topology under `prefix`, of the section's broker and queue type, whose DLQ holds
    /// `n` bench jobs with real x-death headers.
    async fn build_dlq(&self, s: &Section, prefix: &str, n: usize) -> Topology {
        let t = Instant::now();
        let topo = Topology::named(prefix).of_type(s.queue_type);
        let ch = self.channel(s).await;
        topo.declare(&ch).await.expect("topology");
        fixture::dead_letter(&ch, &topo, jobs(n))
            .await
            .expect("dead letters");
        let _ = ch.close(200, "ok".into()).await;
        println!(
            "  [{prefix}] built DLQ {} with {n} dead letters in {:.1}s",
            topo.dlq,
            t.elapsed().as_secs_f64()
        );
        // Let the broker finish writing the persistent messages before a clock starts.
        tokio::time::sleep(Duration::from_secs(2)).await;
        topo
    }

    async fn drop_topology(&self, s: &Section, topo: &Topology, extra_queues: &[&str]) {
        let ch = self.channel(s).await;
        let _ = topo.delete(&ch).await;
        for q in extra_queues {
            let _ = ch
                .queue_delete((*q).into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = ch.close(200, "ok".into()).await;
    }

    async fn depth(&self, ch: &Channel, q: &str) -> u32 {
        fixture::depth(ch, q).await.expect("depth")
    }

    /// RabbitMQ's dynamic Shovel moving the DLQ to a plain queue of the same type.
    async fn shovel(&mut self, s: &Section, rep: usize, n: usize) -> Run {
        let prefix = self.prefix(&format!("{}shovel{rep}", s.tag));
        let topo = self.build_dlq(s, &prefix, n).await;
        let dest = format!("{prefix}.dest");
        let ch = self.channel(s).await;
        ch.queue_declare(
            dest.as_str().into(),
            QueueDeclareOptions::durable(),
            topo.queue_args(),
        )
        .await
        .expect("dest queue");
        let name = format!("{prefix}-shovel");
        let uri = &self.brokers[s.broker].shovel_uri;
        let def = json!({
            "src-protocol": "amqp091",
            "src-uri": uri,
            "src-queue": topo.dlq,
            "dest-protocol": "amqp091",
            "dest-uri": uri,
            "dest-queue": dest,
            "ack-mode": "on-confirm",
            "src-delete-after": "queue-length",
        })
        .to_string();
        let spawned = Instant::now();
        let mut child = self.brokers[s.broker]
            .ctl(&["-q", "set_parameter", "shovel", &name, &def])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("rabbitmqctl");
        // Poll both depths while the CLI runs and after: the clock starts when the parameter is
        // set (the CLI returned) or when the first message moved, whichever comes first; so do
        // the CPU counters (the CLI's own Erlang VM, while it still runs, is among "other").
        let mut returned: Option<(Instant, Usage)> = None;
        let mut first_move: Option<(Instant, Usage)> = None;
        let mut moved_at_return = 0;
        let (mut redis_returned, mut redis_first) = (None, None);
        let deadline = spawned + Duration::from_secs(60 + n as u64 / 200);
        let done = loop {
            if returned.is_none() {
                if let Some(st) = child.try_wait().expect("rabbitmqctl wait") {
                    returned = Some((Instant::now(), self.cpu(s)));
                    redis_returned = Some(redis_counters(&mut self.redis).await);
                    if !st.success() {
                        let mut err = String::new();
                        if let Some(mut e) = child.stderr.take() {
                            use tokio::io::AsyncReadExt;
                            let _ = e.read_to_string(&mut err).await;
                        }
                        panic!("rabbitmqctl set_parameter failed: {err}");
                    }
                    moved_at_return = n as u32 - self.depth(&ch, &topo.dlq).await.min(n as u32);
                }
            }
            let src = self.depth(&ch, &topo.dlq).await;
            let dst = self.depth(&ch, &dest).await;
            let now = Instant::now();
            if first_move.is_none() && (src < n as u32 || dst > 0) {
                first_move = Some((now, self.cpu(s)));
                redis_first = Some(redis_counters(&mut self.redis).await);
            }
            if src == 0 && dst as usize >= n && returned.is_some() {
                break now;
            }
            if now > deadline {
                self.problems.push(format!(
                    "{prefix}: shovel did not finish (source {src}, destination {dst})"
                ));
                break now;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let usage1 = self.cpu(s);
        let redis1 = redis_counters(&mut self.redis).await;
        let (returned, at_return) = returned.expect("returned");
        let ((start, usage0), redis0) = match (first_move, redis_first) {
            (Some((m, u)), Some(r)) if m < returned => ((m, u), r),
            _ => ((returned, at_return), redis_returned.unwrap_or_default()),
        };
        let redis_info = redis_delta(&redis0, &redis1);
        let usage = usage1 - usage0;
        let wall = done.duration_since(start).as_secs_f64();
        let _ = self.brokers[s.broker]
            .ctl(&["-q", "clear_parameter", "shovel", &name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
        let dst = self.depth(&ch, &dest).await;
        if dst as usize != n {
            self.problems
                .push(format!("{prefix}: destination holds {dst}, expected {n}"));
        }
        let _ = ch.close(200, "ok".into()).await;
        self.drop_topology(s, &topo, &[&dest]).await;
        let run = Run {
            n,
            wall,
            rss_kib: None,
            cpu: None,
            usage,
            footprint: None,
            replayed: n as u64,
            redis_info,
            allocs: None,
        };
        println!(
            "  shovel run {rep}{}: {wall:.2}s, {:.0} msg/s (set_parameter CLI took {:.2}s, {moved_at_return} moved before it returned); broker {:.2} CPU/s; {}; {}",
            s.note(),
            run.rate(),
            returned.duration_since(spawned).as_secs_f64(),
            run.usage.broker / wall,
            run.machine_text(),
            run.cost_text()
        );
        run
    }

    /// The ceiling at a window: a bare lapin client in this process that consumes the DLQ
    /// (prefetch = window) on one connection, publishes each message to a plain queue of the
    /// same type with confirms on another, keeps at most `window` publishes unconfirmed, and
    /// acks each original once its copy is confirmed. No Redis, no decisions: what the two
    /// connections and the broker cost. Its CPU is this harness's over the run.
    async fn bare(&mut self, s: &Section, rep: usize, n: usize, window: usize) -> Run {
        use std::collections::VecDeque;
        let prefix = self.prefix(&format!("{}bare{rep}", s.tag));
        let topo = self.build_dlq(s, &prefix, n).await;
        let dest = format!("{prefix}.dest");
        let amqp = self.brokers[s.broker].amqp.clone();
        let src_conn = engine::connect_amqp(&amqp, "bench bare source")
            .await
            .expect("connect");
        let pub_conn = engine::connect_amqp(&amqp, "bench bare publisher")
            .await
            .expect("connect");
        let src = src_conn.create_channel().await.expect("channel");
        let publ = pub_conn.create_channel().await.expect("channel");
        publ.queue_declare(
            dest.as_str().into(),
            QueueDeclareOptions::durable(),
            topo.queue_args(),
        )
        .await
        .expect("dest queue");
        publ.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirms");
        // The prefetch dlq-replay uses for the same window (deliveries waiting in the client are
        // no risk: not yet published); the window bounds the unconfirmed publishes.
        src.basic_qos(
            (window * 8).clamp(64, 1024) as u16,
            BasicQosOptions::default(),
        )
        .await
        .expect("qos");
        let redis0 = redis_counters(&mut self.redis).await;
        let usage0 = self.cpu(s);
        let own0 = proc_cpu_split(std::process::id());
        let started = Instant::now();
        let mut consumer = src
            .basic_consume(
                topo.dlq.as_str().into(),
                "bench-bare".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        // At most `window` publishes unconfirmed; when the window is full, the oldest half is
        // waited for and acked with one `multiple` ack (dlq-replay's steps are half the window
        // too), so the source is acked only for what the destination confirmed.
        let mut inflight = VecDeque::new();
        let (mut received, mut done, mut nacked) = (0usize, 0usize, 0usize);
        let step = (window / 2).max(1);
        while done < n {
            if inflight.len() < window && received < n {
                let Some(Ok(d)) = consumer.next().await else {
                    self.problems.push(format!("{prefix}: bare consumer ended"));
                    break;
                };
                let confirm = publ
                    .basic_publish(
                        "".into(),
                        dest.as_str().into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        &d.data,
                        d.properties.clone(),
                    )
                    .await
                    .expect("publish");
                inflight.push_back((d.delivery_tag, confirm));
                received += 1;
                continue;
            }
            let mut last = None;
            for _ in 0..step.min(inflight.len()) {
                let Some((tag, confirm)) = inflight.pop_front() else {
                    break;
                };
                let confirm: lapin::PublisherConfirm = confirm;
                match confirm.await {
                    Ok(c) if c.is_ack() => {}
                    _ => nacked += 1,
                }
                last = Some(tag);
                done += 1;
            }
            let Some(tag) = last else {
                break;
            };
            src.basic_ack(tag, lapin::options::BasicAckOptions { multiple: true })
                .await
                .expect("ack");
        }
        let wall = started.elapsed().as_secs_f64();
        let own1 = proc_cpu_split(std::process::id());
        let mut usage = self.cpu(s) - usage0;
        let redis_info = redis_delta(&redis0, &redis_counters(&mut self.redis).await);
        let cpu = (
            (own1.0 - own0.0) / self.clk_tck,
            (own1.1 - own0.1) / self.clk_tck,
        );
        // This harness is the measured process here, not a bystander.
        usage.harness = 0.0;
        let _ = src_conn.close(200, "ok".into()).await;
        let _ = pub_conn.close(200, "ok".into()).await;
        let ch = self.channel(s).await;
        let dst = self.depth(&ch, &dest).await;
        if dst as usize != n || nacked > 0 {
            self.problems.push(format!(
                "{prefix}: bare client: destination holds {dst}, expected {n}; {nacked} not confirmed"
            ));
        }
        let _ = ch.close(200, "ok".into()).await;
        self.drop_topology(s, &topo, &[&dest]).await;
        let run = Run {
            n,
            wall,
            rss_kib: None,
            cpu: Some(cpu),
            usage,
            footprint: None,
            replayed: n as u64,
            redis_info,
            allocs: None,
        };
        println!(
            "  bare run {rep}{} (window {window}): {wall:.2}s, {:.0} msg/s; user {:.2}s sys {:.2}s; broker {:.2} CPU/s; {}; {}",
            s.note(),
            run.rate(),
            cpu.0,
            cpu.1,
            run.usage.broker / wall,
            run.machine_text(),
            run.cost_text()
        );
        run
    }

    /// The window `dlq-replay run` gets (BENCH_RUN_ARGS' `--window`, else its default 32).
    fn window(&self) -> usize {
        let mut args = self.run_args.iter();
        while let Some(a) = args.next() {
            let v = match a.strip_prefix("--window") {
                Some("") => args.next().map(String::as_str),
                Some(rest) => rest.strip_prefix('='),
                None => continue,
            };
            if let Some(w) = v.and_then(|v| v.parse().ok()) {
                return w;
            }
        }
        32
    }

    /// `dlq-replay run` on a fresh DLQ of `n`, 10 % of keys done; with `rate`, no keys done and
    /// the arrival times on the target queue are returned too.
    async fn replay(
        &mut self,
        s: &Section,
        scenario: &str,
        n: usize,
        mode: &str,
        extras: Extras,
    ) -> (Run, Vec<f64>) {
        let rate = extras.rate;
        let prefix = self.prefix(scenario);
        let topo = self.build_dlq(s, &prefix, n).await;
        let idem = idem_prefix(&prefix);
        let done = if rate.is_none() {
            self.mark_done(&idem, n).await
        } else {
            0
        };
        let name = prefix.clone();
        let text = self.manifest(s, &prefix, &topo, mode, extras);
        // A sink newer than the library this bench was built with is for the binary to judge:
        // the redis section asked it first (`Bench::accepts`).
        if !extras.audit_log {
            dlq_replay::manifest::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        }
        let file = self.tmp.path().join(format!("{scenario}.yaml"));
        std::fs::write(&file, &text).expect("manifest");

        // With a rate or a canary: a consumer on the target queue (the recovered worker the
        // canary needs) timestamps every arrival.
        let clocked = extras.clock || rate.is_some() || extras.canary_wait.is_some();
        let arrivals = if clocked {
            Some(self.arrival_clock(s, &topo.work, n - done).await)
        } else {
            None
        };
        let other = format!("{prefix}.other");
        let unrelated = match extras.arrivals {
            Some(per_s) => Some(self.unrelated(s, &topo, &other, per_s).await),
            None => None,
        };
        let rss_file = self.tmp.path().join(format!("{scenario}.rss"));
        // BENCH_WRAP: a command line the binary runs under (e.g. valgrind --tool=callgrind).
        let wrap: Vec<String> = std::env::var("BENCH_WRAP")
            .unwrap_or_default()
            .split_whitespace()
            .map(String::from)
            .collect();
        let mut cmd = if !wrap.is_empty() {
            let mut c = tokio::process::Command::new(&wrap[0]);
            c.args(&wrap[1..]).arg(&self.bin);
            c
        } else if self.time_rss {
            let mut c = tokio::process::Command::new("/usr/bin/time");
            c.arg("-f")
                .arg("%M %U %S")
                .arg("-o")
                .arg(&rss_file)
                .arg(&self.bin);
            c
        } else {
            tokio::process::Command::new(&self.bin)
        };
        cmd.args(["run", "-f"])
            .arg(&file)
            .args(["--no-progress", "-o", "json"])
            .args(&self.run_args)
            .env("REDIS_URL", &self.redis_url)
            .env_remove("AMQP_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The replay's keys in Redis: used_memory just before it starts (the done marks are
        // written by then), then a sample every REDIS_SAMPLE_EVERY while it runs.
        let keys = extras
            .footprint
            .then(|| ReplayKeys::new(&name, &idem, &topo.dlq));
        let before = if keys.is_some() {
            Some(used_memory_settled(&mut self.redis).await)
        } else {
            None
        };
        let redis0 = redis_counters(&mut self.redis).await;
        let usage0 = self.cpu(s);
        let started = Instant::now();
        let child = cmd.spawn().expect("spawn dlq-replay");
        let sampler = keys.clone().map(|k| {
            let (stop, stopped) = tokio::sync::oneshot::channel();
            (
                stop,
                tokio::spawn(sample_redis(self.redis.clone(), k, stopped)),
            )
        });
        let pid = child.id();
        let hwm = (!self.time_rss).then(|| tokio::spawn(poll_hwm(pid.unwrap_or(0))));
        let out = tokio::time::timeout(
            Duration::from_secs(600 + n as u64 / 50),
            child.wait_with_output(),
        )
        .await
        .expect("dlq-replay timed out")
        .expect("dlq-replay output");
        let wall = started.elapsed().as_secs_f64();
        let usage = self.cpu(s) - usage0;
        let redis_info = redis_delta(&redis0, &redis_counters(&mut self.redis).await);
        // After the end (the process exited with its final status), before the cleanup below.
        let measured = match (sampler, keys, before) {
            (Some((stop, task)), Some(k), Some(before)) => {
                let _ = stop.send(());
                match task.await {
                    Ok(mut sampled) => {
                        let after = redis_bytes(&mut self.redis, &k).await;
                        sampled.add(&after);
                        Some((before, sampled, after))
                    }
                    Err(e) => {
                        self.problems
                            .push(format!("{prefix}: sampling Redis failed: {e}"));
                        None
                    }
                }
            }
            _ => None,
        };
        let unrelated = match unrelated {
            Some(u) => Some(u.stop().await),
            None => None,
        };
        let (rss_kib, cpu) = if self.time_rss {
            parse_time(&std::fs::read_to_string(&rss_file).unwrap_or_default())
        } else {
            (hwm.expect("hwm").await.ok().flatten(), None)
        };
        let arrivals = match arrivals {
            Some(h) => match tokio::time::timeout(Duration::from_secs(30), h).await {
                Ok(Ok(v)) => v
                    .into_iter()
                    .map(|t| t.duration_since(started).as_secs_f64())
                    .collect(),
                _ => Vec::new(),
            },
            None => Vec::new(),
        };

        // Check what happened: every message is a replay or a duplicate, and the target got them.
        let status: Value = serde_json::from_slice::<Value>(&out.stdout)
            .ok()
            .and_then(|v| v.get("status").cloned())
            .unwrap_or(Value::Null);
        let count = |k: &str| status["counts"][k].as_u64().unwrap_or(u64::MAX);
        let (replayed, dups) = (count("replayed"), count("duplicates"));
        let ch = self.channel(s).await;
        let target = self.depth(&ch, &topo.work).await as u64;
        // Every unrelated dead letter is still in the DLQ: behind the pass, or held back.
        let left = self.depth(&ch, &topo.dlq).await as u64;
        let _ = ch.close(200, "ok".into()).await;
        let expected_target = if clocked { 0 } else { replayed };
        let expected_left = unrelated.unwrap_or(0);
        if !out.status.success()
            || status["phase"] != "Done"
            || replayed + dups != n as u64
            || dups != done as u64
            || target != expected_target
            || left != expected_left
        {
            self.problems.push(format!(
                "{prefix}: exit {:?}, phase {}, replayed {replayed}, duplicates {dups} (expected {done}), target holds {target}, DLQ holds {left} (expected {expected_left}: the unrelated dead letters); stderr: {}",
                out.status.code(),
                status["phase"],
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        if clocked && arrivals.len() != n - done {
            self.problems.push(format!(
                "{prefix}: the consumer saw {} of {} arrivals",
                arrivals.len(),
                n - done
            ));
        }
        self.drop_topology(s, &topo, &[&other]).await;
        self.forget(&idem, &name).await;
        let run = Run {
            n,
            wall,
            rss_kib,
            cpu,
            usage,
            footprint: measured.map(|(before, sampled, after)| Footprint {
                replayed,
                duplicates: dups,
                before,
                sampled,
                after,
            }),
            replayed,
            redis_info,
            allocs: parse_allocs(&out.stderr),
        };
        let cpu_text = run
            .cpu
            .map(|(u, s)| format!("user {u:.2}s sys {s:.2}s ({:.2} CPU/s)", (u + s) / wall))
            .unwrap_or_else(|| "cpu n/a".into());
        println!(
            "  {scenario} ({mode}{}{}{}{}): {wall:.2}s, {:.0} msg/s, replayed {replayed}, duplicates {dups}, skipped {}, peak RSS {}, {cpu_text}; broker {:.2} CPU/s, Redis {:.2} CPU/s; {}; {}",
            rate.map(|r| format!(", {r}/s")).unwrap_or_default(),
            match (extras.canary_wait, unrelated) {
                (Some(w), Some(u)) => format!(", canary {w}s, {u} unrelated dead letters arrived"),
                (None, Some(u)) => format!(", canary off, {u} unrelated dead letters arrived"),
                (Some(w), None) => format!(", canary {w}s"),
                (None, None) => String::new(),
            },
            if extras.audit_log {
                ", audit to the log"
            } else {
                ""
            },
            s.note(),
            run.rate(),
            count("skipped"),
            rss_text(run.rss_kib),
            run.usage.broker / wall,
            run.usage.redis / wall,
            run.machine_text(),
            run.cost_text()
        );
        (run, arrivals)
    }

    /// The manifest of a replay named `prefix` of `topo`'s DLQ (metadata.name is the prefix).
    fn manifest(
        &self,
        s: &Section,
        prefix: &str,
        topo: &Topology,
        mode: &str,
        extras: Extras,
    ) -> String {
        let rate_line = extras
            .rate
            .map(|r| format!("  rate: {{messagesPerSecond: {r}}}\n"))
            .unwrap_or_default();
        let audit_line = if extras.audit_log {
            "  audit: {sink: Log}\n"
        } else {
            ""
        };
        let canary = match extras.canary_wait {
            Some(w) => format!("{{enabled: true, waitSeconds: {w}}}"),
            None => "{enabled: false}".into(),
        };
        format!(
            "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {{name: {prefix}, namespace: {NAMESPACE}}}\nspec:\n  broker: {{url: \"{amqp}\"}}\n  source: {{queue: {dlq}}}\n  quarantine: {{queue: {q}}}\n  canary: {canary}\n  idempotency:\n    mode: {mode}\n    key: {{fields: [{{pointer: /id}}], prefix: \"{idem}\"}}\n{rate_line}{audit_line}",
            amqp = self.brokers[s.broker].amqp,
            dlq = topo.dlq,
            q = topo.quarantine,
            idem = idem_prefix(prefix),
        )
    }

    /// Whether the binary takes the manifest `replay` would run for `scenario` (a spec field
    /// newer than the binary is refused); Err holds its refusal. Asked before the DLQ is built:
    /// `dlq-replay audit -f` reads the manifest first and contacts no broker.
    async fn accepts(
        &self,
        s: &Section,
        scenario: &str,
        mode: &str,
        extras: Extras,
    ) -> Result<(), String> {
        let prefix = self.prefix(scenario);
        let topo = Topology::named(&prefix).of_type(s.queue_type);
        let file = self.tmp.path().join(format!("{scenario}-probe.yaml"));
        std::fs::write(&file, self.manifest(s, &prefix, &topo, mode, extras)).expect("manifest");
        let out = tokio::process::Command::new(&self.bin)
            .args(["audit", "-f"])
            .arg(&file)
            .env("REDIS_URL", &self.redis_url)
            .env_remove("AMQP_URL")
            .output()
            .await
            .expect("spawn dlq-replay");
        // A manifest it refuses is said `error: <file>: <field>: <why>`; any other outcome (this
        // replay has never run) means it parsed it.
        let refused = format!("error: {}: ", file.display());
        match String::from_utf8_lossy(&out.stderr)
            .lines()
            .find_map(|l| l.strip_prefix(refused.as_str()))
        {
            Some(why) => Err(why.to_string()),
            None => Ok(()),
        }
    }

    /// One rate-limited replay; returns its row of the rate table.
    async fn rate(&mut self, count: usize, limit: u32) -> String {
        let (run, arrivals) = self
            .replay(
                &Section::classic_3_10(),
                &format!("rate{limit}"),
                count,
                "Check",
                Extras {
                    rate: Some(limit),
                    ..Default::default()
                },
            )
            .await;
        let label = format!("{limit}/s");
        if arrivals.len() < 2 {
            return format!("{label:<8} {count:>6} (no arrivals measured)");
        }
        let first = arrivals[0];
        let last = arrivals[arrivals.len() - 1];
        let achieved = (arrivals.len() - 1) as f64 / (last - first);
        let over = |w: usize| format!("{w} ({:+.1} %)", (w as f64 / limit as f64 - 1.0) * 100.0);
        let worst = worst_window(&arrivals, 1.0);
        let first_window = arrivals.iter().filter(|&&t| t < first + 1.0).count();
        let later: Vec<f64> = arrivals
            .iter()
            .copied()
            .filter(|&t| t >= first + 1.0)
            .collect();
        format!(
            "{label:<8} {:>6} {achieved:>14.1} {:>18} {first_window:>16} {:>20} {:>10.2}s {:>12.2}s",
            arrivals.len(),
            over(worst),
            over(worst_window(&later, 1.0)),
            last - first,
            run.wall
        )
    }

    /// Start `per_s` unrelated dead letters a second into `topo`'s DLQ, through `other`, a queue
    /// dead-lettering into the same exchange whose consumer rejects everything.
    async fn unrelated(&self, s: &Section, topo: &Topology, other: &str, per_s: u32) -> Unrelated {
        let ch = self.channel(s).await;
        let mut args = FieldTable::default();
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(topo.dlx.as_str().into()),
        );
        ch.queue_declare(other.into(), QueueDeclareOptions::durable(), args)
            .await
            .expect("other queue");
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirms");
        let rejecter = self.channel(s).await;
        let mut consumer = rejecter
            .basic_consume(
                other.into(),
                "bench-rejecter".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume other");
        let rejected = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = rejected.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let _ = d.reject(BasicRejectOptions { requeue: false }).await;
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let other = other.to_string();
        let task = tokio::spawn(async move {
            // From a second on: the replay has read the DLQ's depth by then, so every unrelated
            // dead letter arrives behind the messages the replay started with.
            let period = Duration::from_secs_f64(1.0 / f64::from(per_s));
            let mut tick = tokio::time::interval_at(
                tokio::time::Instant::now() + Duration::from_secs(1),
                period,
            );
            let mut sent = 0u64;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = &mut stopped => break,
                }
                let id = format!("other-{sent:06}");
                let (props, body) =
                    fixture::job(&id, json!({"id": id, "kind": "other"}), "ValueError");
                let confirm = ch
                    .basic_publish(
                        "".into(),
                        other.as_str().into(),
                        BasicPublishOptions::default(),
                        &body,
                        props,
                    )
                    .await
                    .expect("publish other");
                confirm.await.expect("confirm other");
                sent += 1;
            }
            // Each one reaches the DLQ before the harness counts it.
            for _ in 0..200 {
                if rejected.load(std::sync::atomic::Ordering::SeqCst) >= sent {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let _ = rejecter.close(200, "ok".into()).await;
            let _ = ch.close(200, "ok".into()).await;
            sent
        });
        Unrelated { stop, task }
    }

    /// A consumer on `queue` that returns the arrival instants of `n` messages.
    async fn arrival_clock(
        &self,
        s: &Section,
        queue: &str,
        n: usize,
    ) -> tokio::task::JoinHandle<Vec<Instant>> {
        let ch = self.channel(s).await;
        ch.basic_qos(1000, BasicQosOptions::default())
            .await
            .expect("qos");
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                "bench-arrivals".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume");
        tokio::spawn(async move {
            let mut seen = Vec::with_capacity(n);
            while seen.len() < n {
                // The first may wait out a canary's selection pass over a large DLQ.
                let wait = Duration::from_secs(if seen.is_empty() { 600 } else { 60 });
                match tokio::time::timeout(wait, consumer.next()).await {
                    Ok(Some(Ok(_))) => seen.push(Instant::now()),
                    _ => break,
                }
            }
            let _ = ch.close(200, "ok".into()).await;
            seen
        })
    }

    /// Mark the key of every tenth job done; returns how many.
    async fn mark_done(&mut self, idem: &str, n: usize) -> usize {
        let ids: Vec<String> = (0..n).step_by(10).map(job_id).collect();
        for chunk in ids.chunks(1000) {
            let mut p = redis::pipe();
            for id in chunk {
                p.cmd("SET")
                    .arg(key_of(idem, id))
                    .arg("done")
                    .arg("EX")
                    .arg(3600)
                    .ignore();
            }
            p.query_async::<()>(&mut self.redis).await.expect("SET");
        }
        ids.len()
    }

    /// Delete the run's idempotency keys, the replay's state, audit and settled keys, and the
    /// engine's per-queue keys of the run's queues (`dlq:routes:<broker>/<queue>`,
    /// `dlq:moves:...`; they carry no TTL).
    async fn forget(&mut self, idem: &str, name: &str) {
        for pattern in [
            format!("{idem}*"),
            format!("dlq:*:{NAMESPACE}/{name}"),
            format!("dlq:*:{NAMESPACE}/{name}/*"),
            format!("dlq:*/{name}.*"),
        ] {
            let mut cursor: u64 = 0;
            loop {
                let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(5000)
                    .query_async(&mut self.redis)
                    .await
                    .expect("SCAN");
                if !keys.is_empty() {
                    redis::cmd("UNLINK")
                        .arg(&keys)
                        .query_async::<()>(&mut self.redis)
                        .await
                        .expect("UNLINK");
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
    }
}

async fn header(
    b: &Bench,
    args: &[String],
    n: usize,
    reps: usize,
    mem: bool,
    sections: &[Section],
) {
    println!("# dlq-replay benchmark");
    println!(
        "date: {}",
        chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    let via = if std::env::var_os("MAKELEVEL").is_some() {
        " (via make bench)"
    } else {
        ""
    };
    println!("command: {}{via}", args.join(" "));
    let env: Vec<String> = [
        "BENCH_N",
        "BENCH_REPS",
        "BENCH_MEM",
        "BENCH_RUN_ARGS",
        "BENCH_QUEUES",
        "BENCH_BROKERS",
        "BENCH_REDIS_N",
        "BENCH_ROWS",
        "BENCH_WRAP",
    ]
    .iter()
    .map(|k| {
        format!(
            "{k}={}",
            std::env::var(k).unwrap_or_else(|_| "(unset)".into())
        )
    })
    .collect();
    println!("environment: {}", env.join(" "));
    println!(
        "settings: N={n} reps={reps} memory-100k={mem} run-id={} throughput sections: {}",
        b.run_id,
        sections
            .iter()
            .map(|s| s.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let mem_total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("?").to_string())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| format!("{:.1} GiB", kb as f64 / 1048576.0))
        .unwrap_or_else(|| "?".into());
    println!(
        "machine: nproc={} cpu=\"{cpu}\" memory={mem_total} kernel={}",
        nproc(),
        cmd_out("uname", &["-r"]).trim()
    );
    let mut r = b.redis.clone();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut r)
        .await
        .unwrap_or_default();
    let redis_v = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    println!(
        "services: RabbitMQ {} (pid {:?}), Redis {redis_v} (pid {:?})",
        b.brokers[0].version, b.brokers[0].pid, b.redis_pid
    );
    for broker in &b.brokers[1..] {
        println!(
            "services: RabbitMQ {} at {} (pid {:?}; rabbitmqctl: {}; shovel URI host {})",
            broker.version,
            address(&broker.amqp),
            broker.pid,
            broker.ctl.join(" "),
            address(&broker.shovel_uri)
        );
    }
    let commit = cmd_out("git", &["rev-parse", "--short", "HEAD"]);
    let dirty = !cmd_out("git", &["status", "--porcelain"]).trim().is_empty();
    println!(
        "dlq-replay: {} at {}{}",
        b.bin.display(),
        commit.trim(),
        if dirty {
            " (work tree has uncommitted changes)"
        } else {
            ""
        }
    );
    println!(
        "replay command: {}{} run -f <manifest> --no-progress -o json{}  (REDIS_URL={}, manifest: spec.broker.url, idempotency key /id, canary: {{enabled: false}} except in the canary section, audit on)",
        if b.time_rss { "/usr/bin/time -f '%M %U %S' -o <file> " } else { "" },
        b.bin.display(),
        b.run_args.iter().map(|a| format!(" {a}")).collect::<String>(),
        b.redis_url
    );
    println!(
        "peak RSS from: {}",
        if b.time_rss {
            "/usr/bin/time %M (getrusage maxrss of the dlq-replay process)"
        } else {
            "VmHWM in /proc/<pid>/status, polled every 5 ms"
        }
    );
    println!("clocks: dlq-replay = process spawn to exit (connects, drains, writes its final status); shovel = set_parameter returned (or first message moved, if earlier) until source empty and destination holding N, depths polled every 10 ms over AMQP");
}

/// The Shovel plugin on `broker`: enabled with rabbitmq-plugins on RabbitMQ 3.10; on RabbitMQ 4
/// (`.ci/rabbitmq4` enables it at boot, and its CLI is rabbitmqctl only) checked.
fn enable_shovel(broker: &Broker) {
    if broker.name != "3.10" {
        let running = broker.ctl_out(&[
            "-q",
            "eval",
            "lists:keymember(rabbitmq_shovel, 1, application:which_applications()).",
        ]);
        if running.trim() != "true" {
            eprintln!(
                "bench: rabbitmq_shovel is not running on RabbitMQ {} ({}: {:?}); .ci/rabbitmq4 enables it at boot",
                broker.name,
                broker.ctl.join(" "),
                running.trim()
            );
            std::process::exit(2);
        }
        println!("rabbitmq_shovel on RabbitMQ {}: running", broker.name);
        return;
    }
    let enabled = cmd_out("rabbitmq-plugins", &["-q", "list", "-e", "-m"]);
    if enabled.lines().any(|l| l.trim() == "rabbitmq_shovel") {
        println!("rabbitmq_shovel: already enabled");
        return;
    }
    let t = Instant::now();
    let st = std::process::Command::new("rabbitmq-plugins")
        .args(["-q", "enable", "rabbitmq_shovel"])
        .stdout(Stdio::null())
        .status()
        .expect("rabbitmq-plugins");
    assert!(
        st.success(),
        "rabbitmq-plugins enable rabbitmq_shovel failed"
    );
    println!(
        "rabbitmq_shovel: enabled now ({:.1}s)",
        t.elapsed().as_secs_f64()
    );
}

/// The idempotency prefix of the replay named `prefix`: its claims and done marks start so.
fn idem_prefix(prefix: &str) -> String {
    format!("{prefix}:idem:")
}

fn job_id(i: usize) -> String {
    format!("bench-{i:07}")
}

/// The bench jobs: `{"id": ..., "attempt": ..., "padding": ...}` of about BODY_BYTES bytes.
fn jobs(n: usize) -> Vec<(BasicProperties, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let id = job_id(i);
            let base = json!({"id": id, "kind": "bench", "padding": ""})
                .to_string()
                .len();
            let padding: String = (0..BODY_BYTES.saturating_sub(base))
                .map(|k| (b'a' + ((i + k) % 26) as u8) as char)
                .collect();
            fixture::job(
                &id,
                json!({"id": id, "kind": "bench", "padding": padding}),
                "TimeoutError",
            )
        })
        .collect()
}

/// Most arrivals in any window `[t, t + width)` that starts at an arrival.
fn worst_window(times: &[f64], width: f64) -> usize {
    let mut best = 0;
    let mut j = 0;
    for i in 0..times.len() {
        while j < times.len() && times[j] < times[i] + width {
            j += 1;
        }
        best = best.max(j - i);
    }
    best
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn table_row(name: &str, runs: &[Run], shovel_median: f64) {
    let rates: Vec<f64> = runs.iter().map(Run::rate).collect();
    let min = rates.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = rates.iter().cloned().fold(0.0, f64::max);
    let med = median(rates.iter().cloned());
    let wall = median(runs.iter().map(|r| r.wall));
    let rss: Vec<u64> = runs.iter().filter_map(|r| r.rss_kib).collect();
    let (rss_med, rss_range) = if rss.is_empty() {
        ("-".to_string(), "-".to_string())
    } else {
        let med = median(rss.iter().map(|&k| k as f64)) as u64;
        (
            rss_text(Some(med)),
            format!(
                "{:.1}-{:.1} MiB",
                *rss.iter().min().unwrap() as f64 / 1024.0,
                *rss.iter().max().unwrap() as f64 / 1024.0
            ),
        )
    };
    let proc_cpu = median(
        runs.iter()
            .filter_map(|r| r.cpu.map(|c| (c.0 + c.1) / r.wall)),
    );
    let broker = median(runs.iter().map(|r| r.usage.broker / r.wall));
    let other = median(runs.iter().map(|r| r.other() / r.wall));
    println!(
        "{:<19} {:>4} {:>12.0} {:>13} {:>10.2}s {:>9} {:>14} {:>14} {:>10} {:>12.2} {:>11.2}",
        name,
        runs.len(),
        med,
        format!("{min:.0}-{max:.0}"),
        wall,
        format!("{:.2}x", med / shovel_median),
        rss_med,
        rss_range,
        if proc_cpu.is_nan() {
            "-".to_string()
        } else {
            format!("{proc_cpu:.2}")
        },
        broker,
        other
    );
}

fn cost_row(name: &str, runs: &[Run], shovel_median: f64, bare_median: f64) {
    let opt = |v: f64, prec: usize| {
        if v.is_nan() {
            "-".to_string()
        } else {
            format!("{v:.prec$}")
        }
    };
    let rate = median(runs.iter().map(Run::rate));
    println!(
        "{:<19} {:>9} {:>9.1} {:>9.1} {:>9.2} {:>10} {:>10.0} {:>8.2}x {:>8.2}x",
        name,
        opt(median(runs.iter().filter_map(Run::own_us)), 1),
        median(runs.iter().map(Run::broker_us)),
        median(runs.iter().map(Run::redis_us)),
        median(runs.iter().map(Run::redis_calls)),
        opt(median(runs.iter().filter_map(Run::allocs_per)), 1),
        rate,
        rate / shovel_median,
        rate / bare_median
    );
}

fn rss_text(kib: Option<u64>) -> String {
    kib.map(|k| format!("{:.1} MiB", k as f64 / 1024.0))
        .unwrap_or_else(|| "n/a".into())
}

/// `%M %U %S` as written by /usr/bin/time: peak RSS (KiB), user and system seconds.
fn parse_time(text: &str) -> (Option<u64>, Option<(f64, f64)>) {
    // A child killed by a signal makes time write a "Command terminated" line first.
    let line = text.lines().last().unwrap_or("");
    let f: Vec<&str> = line.split_whitespace().collect();
    let rss = f.first().and_then(|v| v.parse().ok());
    let cpu = match (
        f.get(1).and_then(|v| v.parse().ok()),
        f.get(2).and_then(|v| v.parse().ok()),
    ) {
        (Some(u), Some(s)) => Some((u, s)),
        _ => None,
    };
    (rss, cpu)
}

/// Does `/usr/bin/time -f %M -o file` report a peak RSS here?
fn time_works(dir: &Path) -> bool {
    let out = dir.join("probe.time");
    let ok = std::process::Command::new("/usr/bin/time")
        .arg("-f")
        .arg("%M %U %S")
        .arg("-o")
        .arg(&out)
        .arg("true")
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ok && parse_time(&std::fs::read_to_string(&out).unwrap_or_default())
        .0
        .is_some_and(|k| k > 0)
}

/// The last VmHWM (KiB) seen in /proc/<pid>/status before the process went away.
async fn poll_hwm(pid: u32) -> Option<u64> {
    let mut last = None;
    loop {
        let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return last;
        };
        let hwm = s
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok());
        match hwm {
            Some(h) => last = Some(h),
            None => return last, // a zombie has no memory lines
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Busy and iowait clock ticks of all cores, from the first line of /proc/stat.
fn machine_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let get = |i: usize| f.get(i).copied().unwrap_or(0.0);
    // user nice system idle iowait irq softirq steal (guest time is inside user already)
    (get(0) + get(1) + get(2) + get(5) + get(6) + get(7), get(4))
}

/// utime and stime of a process, in clock ticks.
fn proc_cpu_split(pid: u32) -> (f64, f64) {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return (0.0, 0.0);
    };
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| {
        f.get(i - 3)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (get(14), get(15))
}

/// utime + stime of a process, in clock ticks.
fn proc_cpu(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm: state is field 3, utime 14 and stime 15 (1-based over the whole line).
    let get = |i: usize| {
        f.get(i - 3)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    get(14) + get(15)
}

/// The longest-running process of that name (the server, not a CLI's own VM).
fn oldest_process(comm: &str) -> Option<u32> {
    let mut best: Option<(u64, u32)> = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .map(|c| c.trim() != comm)
            .unwrap_or(true)
        {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let start: u64 = rest
            .split_whitespace()
            .nth(22 - 3)
            .and_then(|v| v.parse().ok())
            .unwrap_or(u64::MAX);
        if best.is_none_or(|(s, _)| start < s) {
            best = Some((start, pid));
        }
    }
    best.map(|(_, p)| p)
}

fn nproc() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0)
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace(['_', ','], "").parse().ok())
        .unwrap_or(default)
}

fn cmd_out(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

impl Broker {
    /// RabbitMQ 4 at AMQP4_URL, its rabbitmqctl through `.ci/rabbitmq4 ctl`; Err says why not.
    async fn v4() -> Result<Self, String> {
        let amqp = std::env::var("AMQP4_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5673/%2f".into());
        let at = address(&amqp);
        let conn = match tokio::time::timeout(
            Duration::from_secs(10),
            engine::connect_amqp(&amqp, "dlq-replay bench"),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(format!("{at} does not answer ({e})")),
            Err(_) => return Err(format!("{at} does not answer within 10 s")),
        };
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/rabbitmq4");
        let mut b = Broker {
            name: "4",
            // The Shovel runs inside the node, which shares this host's network.
            shovel_uri: amqp.clone(),
            amqp,
            conn,
            ctl: vec![script.display().to_string(), "ctl".into()],
            pid: None,
            version: String::new(),
        };
        b.version = b.ctl_out(&["-q", "version"]).trim().to_string();
        if !b.version.starts_with('4') {
            return Err(format!(
                "its rabbitmqctl ({}) reports version {:?}",
                b.ctl.join(" "),
                b.version
            ));
        }
        b.pid = node_pid(&b);
        Ok(b)
    }
}

/// The OS pid of the broker's node, as its rabbitmqctl tells it.
fn node_pid(b: &Broker) -> Option<u32> {
    b.ctl_out(&["-q", "eval", "os:getpid()."])
        .trim()
        .trim_matches('"')
        .parse()
        .ok()
}

/// `host:port` of an AMQP URL, without its credentials.
fn address(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) => format!(
            "{}:{}",
            u.host_str().unwrap_or("?"),
            u.port().unwrap_or(5672)
        ),
        Err(_) => "?".into(),
    }
}

/// What BENCH_BROKERS asks for.
#[derive(Debug, Clone, Copy)]
struct BrokerChoice {
    /// Throughput sections on RabbitMQ 3.10.
    v3: bool,
    /// A quorum section on RabbitMQ 4...
    v4: bool,
    /// ...that must run (BENCH_BROKERS names it) rather than be skipped when it does not answer.
    v4_required: bool,
}

/// BENCH_BROKERS: `3.10`, `4` or both, comma-separated; unset, RabbitMQ 3.10 plus RabbitMQ 4
/// when it answers.
fn env_brokers() -> BrokerChoice {
    let Ok(v) = std::env::var("BENCH_BROKERS") else {
        return BrokerChoice {
            v3: true,
            v4: true,
            v4_required: false,
        };
    };
    let mut c = BrokerChoice {
        v3: false,
        v4: false,
        v4_required: true,
    };
    for name in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match name {
            "3.10" | "3" => c.v3 = true,
            "4" | "4.x" | "4.0" => c.v4 = true,
            other => {
                eprintln!("bench: BENCH_BROKERS: {other:?}: expected 3.10 and/or 4");
                std::process::exit(2);
            }
        }
    }
    c
}

/// BENCH_QUEUES: `classic`, `quorum` or both, comma-separated (default both).
fn env_queues() -> Vec<QueueType> {
    let v = std::env::var("BENCH_QUEUES").unwrap_or_else(|_| "classic,quorum".into());
    let mut out = Vec::new();
    for name in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match name.parse::<QueueType>() {
            Ok(q) if !out.contains(&q) => out.push(q),
            Ok(_) => {}
            Err(e) => {
                eprintln!("bench: BENCH_QUEUES: {e}");
                std::process::exit(2);
            }
        }
    }
    out
}
