//! The canary section: what the canary costs a replay now that it has no pre-pass (issue 20),
//! each figure against the same replay with the canary off, alternating, in one run:
//!
//! - the time from the process start to the first drained message, at a shallow and a deep
//!   DLQ (one signature): flat in depth, the canary's wait and little more;
//! - the whole replay's wall time with three interleaved signatures;
//! - the broker's own count of publishes per replayed message over those runs: setting a
//!   message aside publishes nothing;
//! - the drain's speed while another queue's dead letters arrive into the DLQ.

use std::time::Duration;

use dlq_replay::fixture::{self, Topology};
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicRejectOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;

use crate::broker::Section;
use crate::costs::Run;
use crate::env_usize;
use crate::replay::Extras;
use crate::setup::Bench;
use crate::throughput::median;

/// `canary.lookAhead`: the spec's default, which the manifests leave unset. The most messages
/// set aside at once, so the most a replay could publish to set messages aside per wait.
const LOOK_AHEAD: i64 = 1000;

/// Goal: the first drained message leaves within this long after the canary's wait.
const FIRST_SLACK: f64 = 2.0;

/// Goal: the whole replay with the canary on takes at most the canary's wait and this share of
/// the replay with it off longer than it.
const WHOLE_SLACK: f64 = 0.10;

/// Goal: the drain with unrelated arrivals runs at least at this share of its speed canary off.
const DRAIN_SHARE: f64 = 0.90;

/// The signatures of the whole-replay runs: job i fails with the (i mod 3)-th.
const THREE: &[&str] = &["A", "B", "C"];

/// One replay: what it measured and the arrival times on the target (seconds from its start).
type Timed = (Run, Vec<f64>);

/// A failing service's dead letters arriving into the DLQ while a replay runs: jobs published
/// at a steady rate to a queue of their own whose consumer rejects them, so they reach the DLQ
/// through the same dead-letter exchange with real `x-death` headers and their own signature.
pub(crate) struct Unrelated {
    pub(crate) stop: tokio::sync::oneshot::Sender<()>,
    pub(crate) task: tokio::task::JoinHandle<u64>,
}

impl Unrelated {
    /// Stop publishing; how many were published (each rejected into the DLQ by the time this
    /// returns).
    pub(crate) async fn stop(self) -> u64 {
        let _ = self.stop.send(());
        self.task.await.unwrap_or(0)
    }
}

/// The section's parts, each skipped when its size is 0: `BENCH_CANARY_SHALLOW_N` (default
/// 10,000, `reps` runs each) and `BENCH_CANARY_DEEP_N` (default 1,000,000, one run each) for
/// the first drained message, `BENCH_CANARY_N` (default 100,000) for the whole replay with three
/// signatures and for the drain with arrivals.
pub(crate) async fn canary_section(b: &mut Bench, reps: usize) {
    // The canary's `waitSeconds` (default the least the spec allows).
    let wait = env_usize("BENCH_CANARY_WAIT", 5) as u64;
    let shallow = env_usize("BENCH_CANARY_SHALLOW_N", 10_000);
    let deep = env_usize("BENCH_CANARY_DEEP_N", 1_000_000);
    let n = env_usize("BENCH_CANARY_N", 100_000);
    // The runs whose publishes the broker counted, for the table after the first two parts.
    let mut counted: Vec<(String, Timed)> = Vec::new();
    let depths: Vec<(usize, usize)> = [(shallow, reps), (deep, 1)]
        .into_iter()
        .filter(|&(n, _)| n > 0)
        .collect();
    if depths.is_empty() {
        println!("\n== canary, first drained message: skipped (BENCH_CANARY_SHALLOW_N=0, BENCH_CANARY_DEEP_N=0)");
    } else {
        first_drained_part(b, wait, &depths, &mut counted).await;
    }
    if n == 0 {
        println!("\n== canary, whole replay and arrivals: skipped (BENCH_CANARY_N=0)");
        publishes_table(&counted);
        return;
    }
    whole_replay_part(b, wait, n, reps, &mut counted).await;
    publishes_table(&counted);
    arrivals_part(b, wait, n, reps).await;
}

/// `reps` replays of `n` messages each with the canary off and on (`wait`), alternating,
/// named `{name}off{rep}` and `{name}on{rep}`; a consumer on the target clocks every arrival in
/// both (the canary needs one, and the drains compare).
async fn off_on(
    b: &mut Bench,
    name: &str,
    n: usize,
    reps: usize,
    wait: u64,
    extras: Extras,
) -> (Vec<Timed>, Vec<Timed>) {
    let base = Section::classic_3_10();
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for rep in 1..=reps {
        for (canary, runs) in [(None, &mut off), (Some(wait), &mut on)] {
            let scenario = format!("{name}{}{rep}", if canary.is_some() { "on" } else { "off" });
            let extras = Extras {
                canary_wait: canary,
                clock: true,
                ..extras
            };
            runs.push(b.replay(&base, &scenario, n, "Check", extras).await);
        }
    }
    (off, on)
}

/// Canaries the replay sent (its status's canary list; none with the canary off).
fn canaries(run: &Run) -> usize {
    run.outcome
        .as_ref()
        .and_then(|o| o.status["canary"].as_array().map(Vec::len))
        .unwrap_or(0)
}

/// Seconds from the process start to the first drained message: the first arrival after the
/// canaries (each signature's canary arrives before its messages), the second with the canary
/// off (as the earlier runs of this section measured it).
fn first_drained(t: &Timed) -> Option<f64> {
    t.1.get(canaries(&t.0).max(1)).copied()
}

/// Seconds from the process start to the first canary's publish (its status's `sentAt`).
fn canary_sent(run: &Run) -> Option<f64> {
    let o = run.outcome.as_ref()?;
    o.status["canary"]
        .as_array()?
        .iter()
        .filter_map(|c| chrono::DateTime::parse_from_rfc3339(c["sentAt"].as_str()?).ok())
        .map(|t| (t.with_timezone(&chrono::Utc) - o.spawned).num_milliseconds() as f64 / 1000.0)
        .reduce(f64::min)
}

/// Median and `min-max` of some figures, `-` for none.
fn spread(values: &[f64]) -> (f64, String) {
    if values.is_empty() {
        return (f64::NAN, "-".into());
    }
    let (lo, hi) = values
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    (median(values.iter().copied()), format!("{lo:.2}-{hi:.2}"))
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "MISSED"
    }
}

/// Part 1: how long the first drained message waits, at each of `depths` (N, runs each).
async fn first_drained_part(
    b: &mut Bench,
    wait: u64,
    depths: &[(usize, usize)],
    counted: &mut Vec<(String, Timed)>,
) {
    let sizes: Vec<String> = depths
        .iter()
        .map(|(n, r)| format!("N = {n}: {r} run{} each", if *r == 1 { "" } else { "s" }))
        .collect();
    println!(
        "\n== canary, first drained message vs the DLQ's depth (classic DLQ, RabbitMQ 3.10; one signature, 10 % duplicates, Check; canary off vs on (waitSeconds {wait}), alternating; {})",
        sizes.join(", ")
    );
    let mut rows = Vec::new();
    for &(n, reps) in depths {
        let extras = Extras {
            publishes: true,
            ..Default::default()
        };
        let (off, on) = off_on(b, &format!("first{n}"), n, reps, wait, extras).await;
        for t in &on {
            println!(
                "    canary published at {}, first drained at {}",
                secs(canary_sent(&t.0)),
                secs(first_drained(t))
            );
        }
        counted.extend(label_all("first", n, &off, &on));
        rows.push((n, off, on));
    }
    let goal = wait as f64 + FIRST_SLACK;
    println!(
        "{:<10} {:>4} {:>22} {:>22} {:>13} {:>18} {:>10} {:>7}",
        "N",
        "runs",
        "off: first drained",
        "on: first drained",
        "on: min-max",
        "on: canary sent",
        "goal (on)",
        ""
    );
    for (n, off, on) in &rows {
        let firsts = |runs: &[Timed]| runs.iter().filter_map(first_drained).collect::<Vec<_>>();
        let (off_first, _) = spread(&firsts(off));
        let on_firsts = firsts(on);
        let (on_first, on_range) = spread(&on_firsts);
        let (sent, _) = spread(
            &on.iter()
                .filter_map(|t| canary_sent(&t.0))
                .collect::<Vec<_>>(),
        );
        // Every run, not the median, within the goal.
        let ok = on_firsts.len() == on.len() && on_firsts.iter().all(|&f| f <= goal);
        println!(
            "{n:<10} {:>4} {off_first:>21.2}s {on_first:>21.2}s {on_range:>13} {sent:>17.2}s {:>9}s {:>7}",
            on.len(),
            format!("<= {goal:.1}"),
            met(ok)
        );
    }
    println!("  first drained = seconds from the process start to the first replayed message that is not a canary arriving on the target (the second arrival; the first is the canary); medians; canary sent = the canary's status sentAt less the process start; goal: every canary-on run at most waitSeconds + {FIRST_SLACK:.0} s, at every depth");
}

/// Part 2: the whole replay, three signatures interleaved, canary off vs on.
async fn whole_replay_part(
    b: &mut Bench,
    wait: u64,
    n: usize,
    reps: usize,
    counted: &mut Vec<(String, Timed)>,
) {
    println!(
        "\n== canary, whole replay with three interleaved signatures (classic DLQ, RabbitMQ 3.10; N = {n}, x-exception-type cycling {} per message, 10 % duplicates, Check; canary off vs on (waitSeconds {wait}), alternating, {reps} runs each)",
        THREE.join(",")
    );
    let extras = Extras {
        exceptions: THREE,
        publishes: true,
        ..Default::default()
    };
    let (off, on) = off_on(b, "three", n, reps, wait, extras).await;
    counted.extend(label_all("three", n, &off, &on));
    println!(
        "{:<8} {:>4} {:>12} {:>15} {:>20} {:>9}",
        "canary", "runs", "median wall", "min-max", "first drained (med)", "canaries"
    );
    let mut walls = Vec::new();
    for (label, runs) in [("off", &off), ("on", &on)] {
        let (wall, range) = spread(&runs.iter().map(|(r, _)| r.wall).collect::<Vec<_>>());
        let (first, _) = spread(&runs.iter().filter_map(first_drained).collect::<Vec<_>>());
        println!(
            "{label:<8} {:>4} {wall:>11.2}s {range:>15} {first:>19.2}s {:>9}",
            runs.len(),
            runs.iter().map(|(r, _)| canaries(r)).max().unwrap_or(0)
        );
        walls.push(wall);
    }
    let (off_wall, on_wall) = (walls[0], walls[1]);
    let goal = off_wall * (1.0 + WHOLE_SLACK) + wait as f64;
    println!(
        "  on - off = {:.2}s; goal: on <= off + waitSeconds + {:.0} % of off = {off_wall:.2} + {wait} + {:.2} = {goal:.2}s: {}",
        on_wall - off_wall,
        WHOLE_SLACK * 100.0,
        off_wall * WHOLE_SLACK,
        met(on_wall <= goal)
    );
    println!("  wall = process spawn to exit (connects, drains, writes its final status); medians of the runs; first drained = the first arrival on the target after the canaries (one per signature)");
}

/// `{part}{n}{off|on}{rep}` labels of a part's runs, for the publishes table.
fn label_all(part: &str, n: usize, off: &[Timed], on: &[Timed]) -> Vec<(String, Timed)> {
    let label = |canary: &str, i: usize| format!("{part}{n}{canary}{}", i + 1);
    off.iter()
        .enumerate()
        .map(|(i, t)| (label("off", i), t.clone()))
        .chain(
            on.iter()
                .enumerate()
                .map(|(i, t)| (label("on", i), t.clone())),
        )
        .collect()
}

/// Part 3: the broker's publishes over the runs of parts 1 and 2.
fn publishes_table(counted: &[(String, Timed)]) {
    if counted.is_empty() {
        return;
    }
    println!("\n== canary, broker publishes per replayed message (the runs above; counted by RabbitMQ 3.10 itself: rabbitmqctl eval of rabbit_global_counters messages_received_total (AMQP 0-9-1, node-wide) and of each run's classic queues' next_seq_id, before the replay and after it exits)");
    println!(
        "{:<18} {:>8} {:>4} {:>8} {:>6} {:>7} {:>9} {:>8} {:>10} {:>10} {:>8} {:>7} {:>7} {:>6}",
        "run",
        "N",
        "can.",
        "replayed",
        "quar.",
        "harness",
        "publishes",
        "per repl",
        "aside node",
        "aside qs",
        "into DLQ",
        "others",
        "bound",
        ""
    );
    let mut asides: Vec<(String, usize, i64)> = Vec::new();
    for (label, (run, arrivals)) in counted {
        let Some(p) = run.outcome.as_ref().and_then(|o| o.published) else {
            println!("{label:<18} (no counters)");
            continue;
        };
        let status = &run
            .outcome
            .as_ref()
            .map(|o| o.status.clone())
            .unwrap_or_default();
        let quarantined = status["counts"]["quarantined"].as_i64().unwrap_or(0);
        let replayed = run.replayed as i64;
        let arrivals = arrivals.len() as i64;
        // Publishes that landed nowhere in this run: the node's other clients.
        let others = p.node - arrivals - p.into_dlq - p.into_quarantine;
        let aside_node = p.node - replayed - quarantined;
        let aside_queues = aside_node - others;
        let can = canaries(run);
        let bound = LOOK_AHEAD * can as i64;
        println!(
            "{label:<18} {:>8} {can:>4} {replayed:>8} {quarantined:>6} {:>7} {:>9} {:>8.4} {aside_node:>10} {aside_queues:>10} {:>8} {others:>7} {bound:>7} {:>6}",
            run.n,
            p.harness,
            p.node,
            p.node as f64 / replayed.max(1) as f64,
            p.into_dlq,
            met(aside_queues <= bound)
        );
        if can > 0 {
            asides.push((label.clone(), run.n, aside_queues));
        }
    }
    println!("  publishes = messages_received_total after - before, less the harness's own publishes during the run (harness: none in these runs, the arrival clock only consumes); per repl = publishes / replayed (canaries included in replayed); aside node = publishes - replayed - quarantined (what setting messages aside would have published); into DLQ = the run's DLQ's next_seq_id after - before, less what was dead-lettered into it (the replay's publishes into its own DLQ: moves to the tail); others = publishes - arrivals on the target - into DLQ - into quarantine (other clients of the node: the node-wide figure then counts them); aside qs = aside node - others (from the run's own queues: the verdict); bound = lookAhead ({LOOK_AHEAD}) x canaries (one wait each at most); can. = canaries, quar. = quarantined");
    if let (Some(lo), Some(hi)) = (
        asides.iter().min_by_key(|a| a.1),
        asides.iter().max_by_key(|a| a.1),
    ) {
        println!(
            "  set-aside publishes, canary on: {} at N = {} ({}), {} at N = {} ({}): {}",
            lo.2,
            lo.1,
            lo.0,
            hi.2,
            hi.1,
            hi.0,
            if asides.iter().all(|a| a.2 == lo.2) {
                "the same at every depth"
            } else {
                "NOT the same at every depth"
            }
        );
    }
}

/// Part 4: the drain's speed with the canary off and on while unrelated dead letters arrive.
async fn arrivals_part(b: &mut Bench, wait: u64, n: usize, reps: usize) {
    // Unrelated dead letters per second (0: none).
    let per_s = env_usize("BENCH_CANARY_ARRIVALS", 20) as u32;
    println!(
        "\n== canary with arrivals (classic DLQ, RabbitMQ 3.10; N = {n}, 10 % duplicates, Check; {per_s}/s unrelated dead letters (another queue's, own signature) arriving into the DLQ during the whole run; canary off vs on (waitSeconds {wait}), alternating, {reps} runs each)"
    );
    let extras = Extras {
        arrivals: (per_s > 0).then_some(per_s),
        ..Default::default()
    };
    let (off, on) = off_on(b, "canary", n, reps, wait, extras).await;
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
    let mut on_share = f64::NAN;
    for (label, runs) in [("off", &off), ("on", &on)] {
        let rates: Vec<f64> = runs.iter().map(|(_, a)| drain_rate(a)).collect();
        let rate = median(rates.iter().copied());
        let (lo, hi) = rates
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        let first = median(runs.iter().filter_map(|(_, a)| a.get(1).copied()));
        on_share = rate / off_rate;
        println!(
            "{label:<12} {:>4} {rate:>17.0} {:>15} {:>14.2}x {:>11.2}s {:>22.2}s",
            runs.len(),
            format!("{lo:.0}-{hi:.0}"),
            rate / off_rate,
            median(runs.iter().map(|(r, _)| r.wall)),
            first
        );
    }
    println!(
        "  goal: canary-on drain within {:.0} % of canary off (>= {DRAIN_SHARE:.2}x): {on_share:.2}x, {}",
        (1.0 - DRAIN_SHARE) * 100.0,
        met(on_share >= DRAIN_SHARE)
    );
    println!("  drain msg/s = (replayed arrivals on the target after the first - 1) / their time span, from a consumer started before the replay; first drained at = seconds from the process start to the second arrival (with the canary on: the first look-ahead read, the canary's wait, then the drain; the unrelated dead letters arrive behind the messages the replay started with)");
}

/// `1.23s`, or `-` when there is no figure.
fn secs(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.2}s")).unwrap_or_else(|| "-".into())
}

impl Bench {
    /// Start `per_s` unrelated dead letters a second into `topo`'s DLQ, through `other`, a queue
    /// dead-lettering into the same exchange whose consumer rejects everything.
    pub(crate) async fn unrelated(
        &self,
        s: &Section,
        topo: &Topology,
        other: &str,
        per_s: u32,
    ) -> Unrelated {
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
}
