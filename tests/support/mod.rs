//! Test support: real dead letters on the real broker, each test in its own names.
#![allow(dead_code)]

pub mod cluster;
pub mod fake_api;
pub mod faults;

use std::collections::BTreeMap;

use dlq_replay::api::{DlqReplay, DlqReplayStatus};
use dlq_replay::cli::{self, Endpoints};
use dlq_replay::engine::{self, message, store, Options, Replay};
use dlq_replay::fixture::{self, Topology};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use tokio_util::sync::CancellationToken;

pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const REDIS: &str = "redis://127.0.0.1:6379/";

/// One test's private world: a topology, a Redis key prefix and a replay name.
pub struct World {
    pub tag: String,
    pub topo: Topology,
    pub conn: Connection,
    pub ch: Channel,
    pub redis: redis::aio::ConnectionManager,
    pub prefix: String,
}

/// A message as it sat somewhere, for comparisons.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub id: String,
    pub headers: FieldTable,
    pub props: BasicProperties,
    pub body: Vec<u8>,
}

impl World {
    pub async fn new(name: &str) -> Self {
        let tag = format!(
            "t-{name}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let conn = engine::connect_amqp(AMQP, &tag).await.expect("broker");
        let ch = conn.create_channel().await.expect("channel");
        let topo = Topology::named(&tag);
        topo.declare(&ch).await.expect("topology");
        let redis = store::connect(REDIS).await.expect("redis");
        Self {
            prefix: format!("{tag}:idem:"),
            tag,
            topo,
            conn,
            ch,
            redis,
        }
    }

    /// A manifest for this world; `extra` is YAML appended under `spec:` (indented 2).
    pub fn manifest(&self, extra: &str) -> DlqReplay {
        let text = format!(
            "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {{name: {tag}, namespace: tests}}\nspec:\n  broker: {{url: \"{AMQP}\"}}\n  source: {{queue: {dlq}}}\n  quarantine: {{queue: {q}}}\n  canary: {{enabled: false}}\n{extra}",
            tag = self.tag,
            dlq = self.topo.dlq,
            q = self.topo.quarantine,
        );
        dlq_replay::manifest::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    /// The idempotency block used by most tests: key = /id, this world's prefix.
    pub fn idempotency(&self, mode: &str) -> String {
        format!(
            "  idempotency:\n    mode: {mode}\n    key: {{fields: [{{pointer: /id}}], prefix: \"{}\"}}\n",
            self.prefix
        )
    }

    pub fn replay(&self, resource: &DlqReplay) -> Replay {
        let endpoints = Endpoints {
            amqp_url: None,
            redis_url: Some(REDIS.into()),
        };
        cli::resolve(resource, &endpoints).expect("resolve")
    }

    pub async fn run(&self, resource: &DlqReplay) -> DlqReplayStatus {
        run_replay(&self.replay(resource)).await
    }

    /// The replay with its state, claims and audit trail in another Redis.
    pub fn replay_on(&self, resource: &DlqReplay, redis_url: &str) -> Replay {
        let endpoints = Endpoints {
            amqp_url: None,
            redis_url: Some(redis_url.into()),
        };
        cli::resolve(resource, &endpoints).expect("resolve")
    }

    /// A new connection and channel, after the broker went away and came back.
    pub async fn reopen(&mut self) {
        self.conn = engine::connect_amqp(AMQP, &self.tag).await.expect("broker");
        self.ch = self.conn.create_channel().await.expect("channel");
    }

    pub async fn dead_letter(&self, jobs: Vec<(BasicProperties, Vec<u8>)>) {
        fixture::dead_letter(&self.ch, &self.topo, jobs)
            .await
            .expect("dead letters");
    }

    pub fn key(&self, id: &str) -> String {
        dlq_replay::engine::key::key_of(&self.prefix, id)
    }

    pub async fn set(&self, key: &str, value: &str) {
        let mut r = self.redis.clone();
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .arg("EX")
            .arg(600)
            .query_async::<()>(&mut r)
            .await
            .unwrap();
    }

    pub async fn get(&self, key: &str) -> Option<String> {
        let mut r = self.redis.clone();
        redis::cmd("GET")
            .arg(key)
            .query_async(&mut r)
            .await
            .unwrap()
    }

    pub async fn audit(&self, status: &DlqReplayStatus) -> Vec<store::AuditRow> {
        let mut r = self.redis.clone();
        let key = &status.audit.as_ref().expect("audit ref").key;
        store::read_audit(&mut r, key).await.unwrap()
    }

    /// Every message of a queue, taken out (acked).
    pub async fn take(&self, queue: &str) -> Vec<Seen> {
        let ch = self.conn.create_channel().await.unwrap();
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            out.push(seen(&m.delivery));
            m.delivery.ack(BasicAckOptions::default()).await.unwrap();
        }
        let _ = ch.close(200, "ok".into()).await;
        out
    }

    /// Every message of a queue, looked at and put back in place.
    pub async fn peek(&self, queue: &str) -> Vec<Seen> {
        let ch = self.conn.create_channel().await.unwrap();
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            out.push(seen(&m.delivery));
        }
        ch.close(200, "ok".into()).await.unwrap();
        out
    }

    pub async fn depth(&self, queue: &str) -> u32 {
        fixture::depth(&self.ch, queue).await.unwrap()
    }

    pub async fn cleanup(self) {
        let _ = self.topo.delete(&self.ch).await;
        let mut r = self.redis.clone();
        for pattern in [
            format!("{}*", self.prefix),
            format!("dlq:*tests/{}*", self.tag),
        ] {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(&pattern)
                .query_async(&mut r)
                .await
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: Result<(), _> = redis::cmd("DEL").arg(&keys).query_async(&mut r).await;
            }
        }
        let _ = self.conn.close(200, "bye".into()).await;
    }
}

pub async fn run_replay(replay: &Replay) -> DlqReplayStatus {
    let (tx, _rx) = tokio::sync::watch::channel(DlqReplayStatus::default());
    engine::run(replay, &Options::default(), &tx, &CancellationToken::new())
        .await
        .expect("run")
}

pub fn seen(d: &Delivery) -> Seen {
    Seen {
        id: d
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default(),
        headers: d.properties.headers().clone().unwrap_or_default(),
        props: d.properties.clone(),
        body: d.data.clone(),
    }
}

/// Run `program args` to its end; panic with what it printed unless it succeeded.
pub fn must(program: &str, args: &[&str]) -> std::process::Output {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {}: {}{}",
        args.first().copied().unwrap_or_default(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A finished command's exit status, stdout and stderr, for assertion messages and searches.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn header(s: &Seen, name: &str) -> Option<String> {
    s.headers.inner().get(name).and_then(message::value_text)
}

pub fn ids(v: &[Seen]) -> Vec<String> {
    v.iter().map(|s| s.id.clone()).collect()
}

pub fn by_id(v: &[Seen]) -> BTreeMap<String, Seen> {
    v.iter().map(|s| (s.id.clone(), s.clone())).collect()
}

/// A job with a JSON body `{"id": id, ...extra}`.
pub fn job(id: &str, extra: serde_json::Value) -> (BasicProperties, Vec<u8>) {
    let mut body = serde_json::json!({"id": id});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    fixture::job(id, body, "TimeoutError")
}

/// Every message of the target carries an idempotency key, and no key is there twice.
pub fn assert_each_key_once(target: &[Seen]) {
    let keys: std::collections::BTreeSet<String> = target
        .iter()
        .filter_map(|m| header(m, "x-idempotency-key"))
        .collect();
    assert_eq!(
        keys.len(),
        target.len(),
        "a key was published twice (or a message has no key)"
    );
}

pub fn assert_sum(status: &DlqReplayStatus) {
    let c = status.counts;
    assert_eq!(
        c.scanned,
        c.replayed + c.duplicates + c.quarantined + c.skipped + c.failed,
        "{c:?}"
    );
}

impl World {
    /// A worker on the work queue that rejects (into the DLQ, without requeue) the jobs for
    /// which `fails` holds and acks the rest: a fix that is missing, or covers only some jobs.
    pub async fn worker(
        &self,
        fails: impl Fn(&Delivery) -> bool + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        use futures::StreamExt;
        use lapin::options::{BasicConsumeOptions, BasicRejectOptions};
        let ch = self.conn.create_channel().await.unwrap();
        let mut consumer = ch
            .basic_consume(
                self.topo.work.as_str().into(),
                "test-worker".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        tokio::spawn(async move {
            let _keep = ch;
            while let Some(Ok(d)) = consumer.next().await {
                if fails(&d) {
                    let _ = d.reject(BasicRejectOptions { requeue: false }).await;
                } else {
                    let _ = d.ack(BasicAckOptions::default()).await;
                }
            }
        })
    }
}
