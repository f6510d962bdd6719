//! `make faults`: every fault of the fault suite at full size, one after the other, then the
//! table: fault, mode, runs, messages, lost (must be 0), keys published twice (must be 0 in
//! Claim mode). Exits 1 when an invariant broke.
//!
//! The scenarios are the ones `tests/faults.rs` runs at CI sizes (crates/testkit/src/faults.rs);
//! here they also include the broker restart (`rabbitmqctl stop_app` for 10 s), which would
//! break any other test running against the same broker: run it on a quiet machine.
//!
//! Environment: `FAULT_SEED` (kill and cut points; default: the clock, printed), `FAULT_N`
//! (messages of the kill -9 and connection scenarios, default 20,000), `FAULT_KILLS` (default
//! 10), `FAULT_ONLY` (comma-separated scenario prefixes: `fk` kill -9, `fc` close_connection,
//! `fb` broker stop_app, `fp` Redis pause, `fr` Redis kill, `fx` exchange deleted, `fn` nacks,
//! `fl` poison loop, `fq` a node of the three-node RabbitMQ cluster killed, `fs` a Sentinel
//! failover, `fh` a Redis Cluster master killed), `FAULT_TARGET` (the broker and queue type: `classic_3_10`, the default,
//! `quorum_3_10`, `classic_4_x` or `quorum_4_x`; RabbitMQ 4 from `.ci/rabbitmq4`),
//! `DLQ_REPLAY_BIN` (default: `dlq-replay` next to this example's directory).

use std::path::PathBuf;
use std::time::Duration;

use dlq_replay_testkit::faults::{self, NodeLoss, Tally};
use dlq_replay_testkit::ha::{RabbitCluster, RedisHa};
use dlq_replay_testkit::world::{Target, World};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn binary() -> PathBuf {
    if let Ok(p) = std::env::var("DLQ_REPLAY_BIN") {
        return p.into();
    }
    // target/release/examples/faults → target/release/dlq-replay
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("dlq-replay"))
        .expect("target directory")
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let seed = env_or(
        "FAULT_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1),
    );
    let n: usize = env_or("FAULT_N", 20_000);
    let kills: usize = env_or("FAULT_KILLS", 10);
    let bin = binary();
    assert!(bin.exists(), "{} not built", bin.display());
    println!(
        "make faults: FAULT_SEED={seed} FAULT_N={n} FAULT_KILLS={kills}, binary {}",
        bin.display()
    );
    let target = match std::env::var("FAULT_TARGET").as_deref() {
        Err(_) | Ok("classic_3_10") => Target::classic_3_10(),
        Ok("quorum_3_10") => Target::quorum_3_10(),
        Ok("classic_4_x") => Target::classic_4_x(),
        Ok("quorum_4_x") => Target::quorum_4_x(),
        Ok(other) => {
            eprintln!(
                "FAULT_TARGET={other}: one of classic_3_10, quorum_3_10, classic_4_x, quorum_4_x"
            );
            return std::process::ExitCode::from(2);
        }
    };
    println!("target: {target}");
    let mut rows: Vec<Tally> = Vec::new();
    let only: Option<String> = std::env::var("FAULT_ONLY").ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|p| name.starts_with(p)))
    };
    macro_rules! scenario {
        ($name:expr, |$w:ident| $body:expr) => {
            if wanted($name) {
                #[allow(unused_mut)]
                let mut $w = World::on($name, &target).await;
                let started = std::time::Instant::now();
                let t: Tally = $body;
                println!("{}   [{:.0}s]", t.line(), started.elapsed().as_secs_f64());
                rows.push(t);
                $w.cleanup().await;
            }
        };
    }
    scenario!("fk-claim", |w| faults::kill_9(
        &w, &bin, "Claim", n, seed, kills
    )
    .await);
    scenario!("fk-check", |w| faults::kill_9(
        &w, &bin, "Check", n, seed, kills
    )
    .await);
    scenario!("fc-claim", |w| {
        faults::close_connection(&w, "Claim", n, 2000, 5, seed).await
    });
    scenario!("fc-check", |w| {
        faults::close_connection(&w, "Check", n, 2000, 5, seed).await
    });
    scenario!("fb-claim", |w| {
        faults::broker_restart(&mut w, "Claim", n, 1000, Duration::from_secs(10)).await
    });
    scenario!("fp-short", |w| {
        faults::redis_pause(&w, "Claim", n / 4, 1000, Duration::from_secs(3)).await
    });
    scenario!("fp-claim", |w| {
        faults::redis_pause(&w, "Claim", n / 2, 1000, Duration::from_secs(10)).await
    });
    scenario!("fr-claim", |w| {
        faults::redis_restart(&w, "Claim", n / 2, 1000, Duration::from_secs(5)).await
    });
    scenario!("fx-claim", |w| faults::exchange_deleted(
        &w, "Claim", 5000, 1000
    )
    .await);
    scenario!("fn-claim", |w| faults::nacked(&w, "Claim", 1000, 400).await);
    scenario!("fl", |w| faults::poison_loop(&w, 200).await);

    // The clusters (.ci/rabbitmq4-cluster, .ci/redis-ha; a row is skipped, and said so, when its
    // cluster is not up): a RabbitMQ node lost, on the three-node cluster with quorum queues; the
    // Redis master lost behind Sentinel and in a Redis Cluster, on FAULT_TARGET's broker.
    macro_rules! on_cluster {
        ($name:expr, $loss:expr) => {
            if wanted($name) {
                if let Some(cluster) = RabbitCluster::get() {
                    cluster.heal();
                    let mut w = World::on($name, &RabbitCluster::target(&[1, 2, 3])).await;
                    let started = std::time::Instant::now();
                    let t =
                        faults::rabbit_node_lost(&mut w, cluster, $loss, "Claim", n, 2000).await;
                    println!("{}   [{:.0}s]", t.line(), started.elapsed().as_secs_f64());
                    rows.push(t);
                    w.cleanup().await;
                }
            }
        };
    }
    on_cluster!("fq-node", NodeLoss::Connected);
    on_cluster!("fq-leader", NodeLoss::Leader);
    for (name, ha, mode) in [
        ("fs-claim", RedisHa::Sentinel, "Claim"),
        ("fs-check", RedisHa::Sentinel, "Check"),
        ("fh-claim", RedisHa::Cluster, "Claim"),
    ] {
        if let Some(ha) = ha.get().filter(|_| wanted(name)) {
            let w = World::on(name, &target).await;
            let started = std::time::Instant::now();
            let t = faults::redis_master_lost(&w, ha, mode, n / 2, 2000).await;
            println!("{}   [{:.0}s]", t.line(), started.elapsed().as_secs_f64());
            rows.push(t);
            w.cleanup().await;
        }
    }

    println!("\n{}", Tally::header());
    for t in &rows {
        println!("{}", t.line());
    }
    let bad = rows.iter().filter(|t| !t.ok()).count();
    let lost: usize = rows.iter().map(|t| t.lost).sum();
    let twice: usize = rows
        .iter()
        .filter(|t| t.mode == "Claim")
        .map(|t| t.twice)
        .sum();
    println!(
        "\n{} scenarios, {} messages, {lost} lost, {twice} keys twice in Claim mode, {bad} with a broken invariant (FAULT_SEED={seed})",
        rows.len(),
        rows.iter().map(|t| t.messages).sum::<usize>()
    );
    if bad == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
