//! The harness: its connections, the DLQs it builds for each run and drops after it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dlq_replay::engine::store;
use dlq_replay::engine::store::Redis;
use dlq_replay::fixture::{self, QueueType, Topology};
use lapin::options::QueueDeleteOptions;
use lapin::{BasicProperties, Channel};
use serde_json::json;

use crate::broker::{node_pid, Broker, Section};
use crate::costs::{cmd_out, machine_cpu, oldest_process, proc_cpu, time_works, Usage};
use crate::{env_brokers, BrokerChoice, BODY_BYTES};

pub(crate) struct Bench {
    pub(crate) redis_url: String,
    pub(crate) bin: PathBuf,
    pub(crate) run_id: String,
    /// RabbitMQ 3.10 first (always: rate accuracy and memory run there), then RabbitMQ 4 when
    /// BENCH_BROKERS asks for it and it answers.
    pub(crate) brokers: Vec<Broker>,
    pub(crate) choice: BrokerChoice,
    pub(crate) redis: Redis,
    pub(crate) time_rss: bool,
    /// Extra arguments of `dlq-replay run`, from BENCH_RUN_ARGS (e.g. `--window 128`).
    pub(crate) run_args: Vec<String>,
    pub(crate) redis_pid: Option<u32>,
    pub(crate) clk_tck: f64,
    pub(crate) problems: Vec<String>,
    pub(crate) tmp: tempfile::TempDir,
}

impl Bench {
    pub(crate) async fn new() -> Self {
        let amqp = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let redis_url =
            std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        let conn = dlq_replay::fixture::connect(&amqp, "dlq-replay bench")
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
    pub(crate) fn sections(&self, queues: &[QueueType]) -> Vec<Section> {
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

    pub(crate) fn prefix(&self, scenario: &str) -> String {
        format!("bench-{}-{scenario}", self.run_id)
    }

    pub(crate) async fn channel(&self, s: &Section) -> Channel {
        self.brokers[s.broker]
            .conn
            .create_channel()
            .await
            .expect("channel")
    }

    /// CPU counters now, the broker's being that of section `s`.
    pub(crate) fn cpu(&self, s: &Section) -> Usage {
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
    /// `n` bench jobs with real x-death headers (`exceptions`: see [`jobs`]).
    pub(crate) async fn build_dlq(
        &self,
        s: &Section,
        prefix: &str,
        n: usize,
        exceptions: &[&str],
    ) -> Topology {
        let t = Instant::now();
        let topo = Topology::named(prefix).of_type(s.queue_type);
        let ch = self.channel(s).await;
        topo.declare(&ch).await.expect("topology");
        // In chunks: a million jobs built at once would hold over a gigabyte here and in the
        // work queue before the first is dead-lettered.
        for start in (0..n).step_by(FILL_CHUNK) {
            let end = (start + FILL_CHUNK).min(n);
            fixture::dead_letter(&ch, &topo, jobs(start..end, exceptions))
                .await
                .expect("dead letters");
        }
        let _ = ch.close(200, "ok".into()).await;
        println!(
            "  [{prefix}] built DLQ {} with {n} dead letters{} in {:.1}s",
            topo.dlq,
            signatures_text(exceptions),
            t.elapsed().as_secs_f64()
        );
        // Let the broker finish writing the persistent messages before a clock starts.
        tokio::time::sleep(Duration::from_secs(2)).await;
        topo
    }

    pub(crate) async fn drop_topology(&self, s: &Section, topo: &Topology, extra_queues: &[&str]) {
        let ch = self.channel(s).await;
        let _ = topo.delete(&ch).await;
        for q in extra_queues {
            let _ = ch
                .queue_delete((*q).into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = ch.close(200, "ok".into()).await;
    }

    pub(crate) async fn depth(&self, ch: &Channel, q: &str) -> u32 {
        fixture::depth(ch, q).await.expect("depth")
    }
}

pub(crate) fn job_id(i: usize) -> String {
    format!("bench-{i:07}")
}

/// Jobs dead-lettered per `fixture::dead_letter` call when a DLQ is built.
const FILL_CHUNK: usize = 100_000;

/// The exception of every job when none is asked for: one failure signature.
const EXCEPTION: &str = "TimeoutError";

/// The bench jobs numbered `range`: `{"id": ..., "kind": ..., "padding": ...}` of about
/// BODY_BYTES bytes, job i failed with `exceptions[i % len]` (its `x-exception-type`, the
/// canary's signature), or all with [`EXCEPTION`] when `exceptions` is empty.
pub(crate) fn jobs(
    range: std::ops::Range<usize>,
    exceptions: &[&str],
) -> Vec<(BasicProperties, Vec<u8>)> {
    range
        .map(|i| {
            let id = job_id(i);
            let base = json!({"id": id, "kind": "bench", "padding": ""})
                .to_string()
                .len();
            let padding: String = (0..BODY_BYTES.saturating_sub(base))
                .map(|k| (b'a' + ((i + k) % 26) as u8) as char)
                .collect();
            let exception = match exceptions {
                [] => EXCEPTION,
                some => some[i % some.len()],
            };
            fixture::job(
                &id,
                json!({"id": id, "kind": "bench", "padding": padding}),
                exception,
            )
        })
        .collect()
}

/// `, x-exception-type cycling A,B,C` in a build line when the jobs have several signatures.
pub(crate) fn signatures_text(exceptions: &[&str]) -> String {
    if exceptions.len() > 1 {
        format!(", x-exception-type cycling {}", exceptions.join(","))
    } else {
        String::new()
    }
}
