//! The canary section: drains with the canary off and on while unrelated dead letters arrive.

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
use crate::env_usize;
use crate::replay::Extras;
use crate::setup::Bench;
use crate::throughput::median;

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

pub(crate) async fn canary_section(b: &mut Bench, n: usize, reps: usize) {
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
