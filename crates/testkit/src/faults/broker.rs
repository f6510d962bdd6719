//! Faults of the broker: its connections cut, a `stop_app` restart, the target exchange deleted, a
//! full target queue that nacks, poison that keeps dying.

use super::*;

/// The `rabbitmqctl` pids of this world's replay connections (on the world's broker).
pub(super) fn replay_connections(w: &World) -> Vec<String> {
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
pub(super) struct BrokerDown(Broker);

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
        redis_url(),
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
