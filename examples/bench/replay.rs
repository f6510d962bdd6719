//! One `dlq-replay run`: its manifest, the process, what it left in Redis and the check that
//! every message is accounted for.

use std::process::Stdio;
use std::time::{Duration, Instant};

use dlq_replay::engine::key::key_of;
use dlq_replay::fixture::Topology;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use serde_json::Value;

use crate::broker::Section;
use crate::costs::{
    parse_allocs, parse_time, poll_hwm, redis_counters, redis_delta, rss_text, Outcome, Run,
};
use crate::counters::Published;
use crate::footprint::{redis_bytes, sample_redis, used_memory_settled, Footprint, ReplayKeys};
use crate::setup::{job_id, Bench};
use crate::NAMESPACE;

/// What a replay run adds to the plain unbounded drain.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Extras {
    /// `rate.messagesPerSecond`.
    pub(crate) rate: Option<u32>,
    /// Canary on, with this `waitSeconds` (off when none).
    pub(crate) canary_wait: Option<u64>,
    /// Unrelated dead letters per second arriving into the DLQ during the run.
    pub(crate) arrivals: Option<u32>,
    /// A consumer on the target queue timestamps every arrival (always with a rate or a
    /// canary, which needs a consumer there).
    pub(crate) clock: bool,
    /// `spec.audit.sink: Log`: the audit rows go to the log instead of a Redis stream.
    pub(crate) audit_log: bool,
    /// Weigh the replay's Redis keys while it runs and after it ends (`Run::footprint`).
    pub(crate) footprint: bool,
    /// The jobs' `x-exception-type`, cycling (their failure signatures); empty: one for all.
    pub(crate) exceptions: &'static [&'static str],
    /// Read the broker's own counters before and after the replay (`Outcome::published`).
    pub(crate) publishes: bool,
}

impl Bench {
    /// `dlq-replay run` on a fresh DLQ of `n`, 10 % of keys done; with `rate`, no keys done and
    /// the arrival times on the target queue are returned too.
    pub(crate) async fn replay(
        &mut self,
        s: &Section,
        scenario: &str,
        n: usize,
        mode: &str,
        extras: Extras,
    ) -> (Run, Vec<f64>) {
        let rate = extras.rate;
        let prefix = self.prefix(scenario);
        let topo = self.build_dlq(s, &prefix, n, extras.exceptions).await;
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
        // The broker's counters, before the harness's own publishes of the run start.
        let counted = [topo.dlq.as_str(), topo.quarantine.as_str()];
        let counts0 = if extras.publishes {
            self.brokers[s.broker].counts(&counted).await
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
        let spawned = chrono::Utc::now();
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
        // Once the harness stopped publishing too.
        let counts1 = match counts0 {
            Some(_) => self.brokers[s.broker].counts(&counted).await,
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
        let published = match (&counts0, &counts1) {
            (Some(before), Some(after)) => Some(Published::between(
                before,
                after,
                unrelated.unwrap_or(0),
                status["counts"]["returned"].as_u64().unwrap_or(0),
            )),
            (Some(_), None) | (None, Some(_)) => {
                self.problems.push(format!(
                    "{prefix}: rabbitmqctl did not give the broker's counters"
                ));
                None
            }
            (None, None) => None,
        };
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
            outcome: Some(Outcome {
                status: status.clone(),
                spawned,
                published,
            }),
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
    pub(crate) fn manifest(
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
    pub(crate) async fn accepts(
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

    /// A consumer on `queue` that returns the arrival instants of `n` messages.
    pub(crate) async fn arrival_clock(
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
                // The first may wait out the broker and a slow start (a canary's wait, too).
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
    pub(crate) async fn mark_done(&mut self, idem: &str, n: usize) -> usize {
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
    pub(crate) async fn forget(&mut self, idem: &str, name: &str) {
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

/// The idempotency prefix of the replay named `prefix`: its claims and done marks start so.
pub(crate) fn idem_prefix(prefix: &str) -> String {
    format!("{prefix}:idem:")
}
