//! The throughput section: Shovel, the bare client and dlq-replay on the same DLQs, and the
//! throughput and cost tables.

use std::process::Stdio;
use std::time::{Duration, Instant};

use dlq_replay::engine;
use futures::StreamExt;
use lapin::options::QueueDeclareOptions;
use serde_json::json;

use crate::broker::Section;
use crate::costs::{nproc, proc_cpu_split, redis_counters, redis_delta, rss_text, Run, Usage};
use crate::replay::Extras;
use crate::setup::Bench;
use crate::BODY_BYTES;

/// The throughput part: every section's Shovel, bare-client, Check and Claim runs, alternating,
/// then its tables.
pub(crate) async fn throughput_section(b: &mut Bench, sections: &[Section], n: usize, reps: usize) {
    // Throughput: shovel, Check, Claim, alternating, section after section within each round.
    let mut shovel = vec![Vec::new(); sections.len()];
    let mut check = vec![Vec::new(); sections.len()];
    let mut claim = vec![Vec::new(); sections.len()];
    let mut bare = vec![Vec::new(); sections.len()];
    let mut routed = vec![Vec::new(); sections.len()];
    let mut check_log = vec![Vec::new(); sections.len()];
    let window = b.window();
    // BENCH_ROWS picks the rows (default all): e.g. `check,claim` with a count-allocs or a
    // BENCH_WRAP'd (callgrind) binary. `checklog` (not a default row): Check with the audit rows
    // sent to the log, so the landing's Redis commit writes no stream entries: how much of the
    // gap to the bare client the rows' XADDs on the window's path make.
    let rows_env =
        std::env::var("BENCH_ROWS").unwrap_or_else(|_| "shovel,bare,routed,check,claim".into());
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
                bare[i].push(b.bare(s, rep, n, window, BareTo::OwnQueue).await);
            }
            if rows.contains(&"routed") {
                routed[i].push(b.bare(s, rep, n, window, BareTo::Original).await);
            }
            if rows.contains(&"check") {
                check[i].push(
                    b.replay(s, &format!("{t}check{rep}"), n, "Check", Extras::default())
                        .await
                        .0,
                );
            }
            if rows.contains(&"checklog") {
                let extras = Extras {
                    audit_log: true,
                    ..Extras::default()
                };
                check_log[i].push(
                    b.replay(s, &format!("{t}checklog{rep}"), n, "Check", extras)
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
    // The rows of the section `i`, in order: the references (Shovel, the bare client) first.
    let named = |i: usize| {
        [
            ("shovel (on-confirm)", &shovel[i]),
            ("bare client", &bare[i]),
            ("bare, routed", &routed[i]),
            ("dlq-replay Check", &check[i]),
            ("dlq-replay Claim", &claim[i]),
            ("Check, audit to log", &check_log[i]),
        ]
    };
    // A row BENCH_ROWS left out is not printed.
    let ran = |(_, runs): &(&str, &Vec<Run>)| !runs.is_empty();
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
        for (name, runs) in named(i).into_iter().filter(ran) {
            table_row(name, runs, shovel_median);
        }
    }
    println!(
        "\n== cost per message (medians; CPU us per DLQ message; Redis: its own INFO cpu and commandstats, commands per replayed message; allocations per replayed message when the binary was built with --features count-allocs; bare client: consume (prefetch as dlq-replay), publish with at most {window} unconfirmed to a queue of its own through the default exchange (as Shovel's dest-queue), ack the oldest half-window with one multiple ack once confirmed, in this harness; bare, routed: the same, publishing where dlq-replay does, through the dead letter's exchange and routing key into its work queue; vs bare: against the bare client's median)"
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
        for (name, runs) in named(i).into_iter().filter(ran) {
            cost_row(name, runs, shovel_median, bare_median);
        }
    }
    // Each rep runs every row back to back, so a ratio within one rep leaves out how the machine
    // drifts between reps (seen: the bare client 5,500-9,400 msg/s within one bench).
    println!(
        "\n== paired ratios (each run against the bare client's and Shovel's run of the same round, alternating rows; median and min-max over the rounds)"
    );
    println!(
        "{:<19} {:>12} {:>13} {:>12} {:>13}",
        "scenario", "vs bare", "min-max", "vs Shovel", "min-max"
    );
    for (i, s) in sections.iter().enumerate() {
        println!("{}:", s.label);
        // Shovel and the bare client are the references, not rows of this table.
        for (name, runs) in named(i).into_iter().skip(2).filter(ran) {
            paired_row(name, runs, &bare[i], &shovel[i]);
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
}

impl Bench {
    /// RabbitMQ's dynamic Shovel moving the DLQ to a plain queue of the same type.
    pub(crate) async fn shovel(&mut self, s: &Section, rep: usize, n: usize) -> Run {
        let prefix = self.prefix(&format!("{}shovel{rep}", s.tag));
        let topo = self.build_dlq(s, &prefix, n, &[]).await;
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
            outcome: None,
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

    /// The ceiling at a window: a bare client (the engine's own AMQP client, `engine::amqp`)
    /// in this process that consumes the DLQ (prefetch = window) on one connection, publishes
    /// each message with confirms on another (`to`: a plain queue of the same type, or where
    /// dlq-replay publishes), keeps at most `window` publishes unconfirmed, and acks each
    /// original once its copy is confirmed. No Redis, no decisions: what the two connections
    /// and the broker cost. Its CPU is this harness's over the run.
    pub(crate) async fn bare(
        &mut self,
        s: &Section,
        rep: usize,
        n: usize,
        window: usize,
        to: BareTo,
    ) -> Run {
        use engine::amqp::{Confirmation, Connection, QueueDeclare};
        use std::collections::VecDeque;
        let label = match to {
            BareTo::OwnQueue => "bare",
            BareTo::Original => "routed",
        };
        let prefix = self.prefix(&format!("{}{label}{rep}", s.tag));
        let topo = self.build_dlq(s, &prefix, n, &[]).await;
        let own = format!("{prefix}.dest");
        let (exchange, key, dest) = match to {
            BareTo::OwnQueue => ("", own.as_str(), own.as_str()),
            BareTo::Original => (
                topo.exchange.as_str(),
                dlq_replay::fixture::ROUTING_KEY,
                topo.work.as_str(),
            ),
        };
        let amqp = self.brokers[s.broker].amqp.clone();
        let src_conn = Connection::connect(&amqp, "bench bare source")
            .await
            .expect("connect");
        let pub_conn = Connection::connect(&amqp, "bench bare publisher")
            .await
            .expect("connect");
        let src = src_conn.create_channel().await.expect("channel");
        let publ = pub_conn.create_channel().await.expect("channel");
        let durable = QueueDeclare {
            durable: true,
            ..Default::default()
        };
        if to == BareTo::OwnQueue {
            publ.queue_declare(dest, durable, topo.queue_args())
                .await
                .expect("dest queue");
        }
        publ.confirm_select().await.expect("confirms");
        // The prefetch dlq-replay uses for the same window (deliveries waiting in the client are
        // no risk: not yet published); the window bounds the unconfirmed publishes.
        src.basic_qos((window * 8).clamp(64, 1024) as u16)
            .await
            .expect("qos");
        let redis0 = redis_counters(&mut self.redis).await;
        let usage0 = self.cpu(s);
        let own0 = proc_cpu_split(std::process::id());
        let started = Instant::now();
        let mut consumer = src
            .basic_consume(&topo.dlq, "bench-bare")
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
                    .basic_publish(exchange, key, true, d.properties.clone(), &d.data)
                    .expect("publish")
                    .expect("a confirm");
                inflight.push_back((d.delivery_tag, confirm));
                received += 1;
                continue;
            }
            let mut last = None;
            for _ in 0..step.min(inflight.len()) {
                let Some((tag, confirm)) = inflight.pop_front() else {
                    break;
                };
                match confirm.await {
                    Ok(Confirmation::Ack(None)) => {}
                    _ => nacked += 1,
                }
                last = Some(tag);
                done += 1;
            }
            let Some(tag) = last else {
                break;
            };
            src.basic_ack(tag, true).expect("ack");
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
        let _ = src_conn.close(200, "ok").await;
        let _ = pub_conn.close(200, "ok").await;
        let ch = self.channel(s).await;
        let dst = self.depth(&ch, dest).await;
        if dst as usize != n || nacked > 0 {
            self.problems.push(format!(
                "{prefix}: {label} client: destination holds {dst}, expected {n}; {nacked} not confirmed"
            ));
        }
        let _ = ch.close(200, "ok".into()).await;
        self.drop_topology(s, &topo, &[&own]).await;
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
            outcome: None,
        };
        println!(
            "  {label} run {rep}{} (window {window}): {wall:.2}s, {:.0} msg/s; user {:.2}s sys {:.2}s; broker {:.2} CPU/s; {}; {}",
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
    pub(crate) fn window(&self) -> usize {
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
}

pub(crate) fn median(values: impl Iterator<Item = f64>) -> f64 {
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

pub(crate) fn table_row(name: &str, runs: &[Run], shovel_median: f64) {
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

pub(crate) fn cost_row(name: &str, runs: &[Run], shovel_median: f64, bare_median: f64) {
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

/// A row's rates over those of the reference rows' runs of the same rounds: median and range,
/// for the bare client and for Shovel ("-" where that reference did not run).
fn paired_row(name: &str, runs: &[Run], bare: &[Run], shovel: &[Run]) {
    let ratios = |reference: &[Run]| -> (String, String) {
        let r: Vec<f64> = runs
            .iter()
            .zip(reference)
            .map(|(a, b)| a.rate() / b.rate())
            .collect();
        if r.is_empty() {
            return ("-".into(), "-".into());
        }
        let min = r.iter().cloned().fold(f64::INFINITY, f64::min);
        let max = r.iter().cloned().fold(0.0, f64::max);
        (
            format!("{:.2}x", median(r.iter().cloned())),
            format!("{min:.2}-{max:.2}x"),
        )
    };
    let (vs_bare, bare_range) = ratios(bare);
    let (vs_shovel, shovel_range) = ratios(shovel);
    println!("{name:<19} {vs_bare:>12} {bare_range:>13} {vs_shovel:>12} {shovel_range:>13}");
}

/// Where the bare client publishes (see [`Bench::bare`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum BareTo {
    /// A queue of its own, through the default exchange (as Shovel's `dest-queue`).
    OwnQueue,
    /// Where dlq-replay publishes: the dead letter's exchange and routing key, into its work
    /// queue.
    Original,
}
