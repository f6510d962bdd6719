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
//! The canary section (also classic, RabbitMQ 3.10) replays with the canary off and on
//! (`BENCH_CANARY_WAIT`, default 5 s), alternating, `BENCH_CANARY_REPS` times each (default 2),
//! and prints beside each other: the time to the first drained message at
//! `BENCH_CANARY_SHALLOW_N` (default 10,000) and `BENCH_CANARY_DEEP_N` messages (default
//! 1,000,000, one run each; a million takes about ten minutes to build twice and drain), the
//! whole replay's wall time with three interleaved signatures and the broker's own count of
//! publishes per replayed message, at `BENCH_CANARY_N` (default 100,000), and the drain's speed
//! at `BENCH_CANARY_N` while unrelated dead letters arrive into the DLQ at
//! `BENCH_CANARY_ARRIVALS` a second (default 20). A size of 0 skips its parts.
//!
//! The redis section (classic, RabbitMQ 3.10) measures a replay's footprint in Redis: it replays
//! `BENCH_REDIS_N` messages (default 100,000; 0 skips it) in Check and Claim mode with the audit
//! in Redis, and in Check mode with `spec.audit.sink: Log`, and prints per key kind (audit,
//! settled marks, state, claims, ledger, routes) and for `INFO memory`'s `used_memory` the bytes
//! per replayed message at the peak (sampled while the replay runs) and after it ends `Done`.
//! `BENCH_SECTIONS` (default `throughput,rate,memory,redis,canary`) picks the parts to run.

mod broker;
mod canary;
mod costs;
mod counters;
mod footprint;
mod memory;
mod rate;
mod replay;
mod setup;
mod throughput;

use dlq_replay::fixture::QueueType;

use crate::broker::{address, enable_shovel, Section};
use crate::canary::canary_section;
use crate::costs::{cmd_out, nproc};
use crate::footprint::redis_section;
use crate::memory::memory_section;
use crate::rate::rate_section;
use crate::setup::Bench;
use crate::throughput::throughput_section;

const BODY_BYTES: usize = 1024;
/// The parts of the bench, in order; `BENCH_SECTIONS` picks some.
const ALL_SECTIONS: [&str; 5] = ["throughput", "rate", "memory", "redis", "canary"];
const NAMESPACE: &str = "bench";

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
        throughput_section(&mut b, &sections, n, reps).await;
    } else {
        println!("\n== throughput: skipped (BENCH_SECTIONS)");
    }

    if sections_wanted.contains(&"rate") {
        rate_section(&mut b).await;
    } else {
        println!("\n== rate: skipped (BENCH_SECTIONS)");
    }

    if sections_wanted.contains(&"memory") {
        memory_section(&mut b, mem).await;
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
        // What the canary costs a replay, each figure against the same replay with it off.
        canary_section(&mut b, env_usize("BENCH_CANARY_REPS", 2).max(1)).await;
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
        "BENCH_SECTIONS",
        "BENCH_CANARY_REPS",
        "BENCH_CANARY_WAIT",
        "BENCH_CANARY_SHALLOW_N",
        "BENCH_CANARY_DEEP_N",
        "BENCH_CANARY_N",
        "BENCH_CANARY_ARRIVALS",
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

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace(['_', ','], "").parse().ok())
        .unwrap_or(default)
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
