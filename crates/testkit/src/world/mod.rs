//! One test's world: real dead letters on the real broker, each test in its own names.
//!
//! The broker-touching tests run as a matrix: {RabbitMQ 3.10 on 127.0.0.1:5672, RabbitMQ 4.x on
//! 127.0.0.1:5673 (`AMQP4_URL`)} × {classic, quorum} queues ([`Target`], [`matrix`], the
//! [`matrix!`] macro). A scenario is `async fn scenario(t: Target)` building its world with
//! [`World::on`]; `matrix!(scenario);` makes one test per case, named e.g.
//! `scenario::classic_3_10`. RabbitMQ 4.x cases are skipped (said once on stderr) when it does not
//! answer, unless `REQUIRE_RABBITMQ4=1`.

mod seen;
mod target;

pub use seen::*;
pub use target::*;
// The macro is exported at the crate root (`dlq_replay_testkit::matrix!`); here too, so that
// `use dlq_replay_testkit::world::*;` brings it along.
pub use crate::matrix;

use dlq_replay_api::{DlqReplay, ReplayStatus};
use dlq_replay_engine::{self as engine, store, Options, Replay};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use tokio_util::sync::CancellationToken;

pub use crate::fixture::QueueType;
use crate::fixture::{self, Topology};

/// RabbitMQ 3.10's AMQP URL (the one `World::new` uses).
pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// RabbitMQ 4.x's AMQP URL unless `AMQP4_URL` says otherwise.
pub const AMQP4: &str = "amqp://guest:guest@127.0.0.1:5673/%2f";
/// RabbitMQ 4.x's management API unless `RABBITMQ4_MGMT` says otherwise.
pub const MANAGEMENT4: &str = "http://127.0.0.1:15673";
/// The local Redis.
pub const LOCAL_REDIS: &str = "redis://127.0.0.1:6379/";

/// The Redis the worlds and their replays use: the local one, or `TEST_REDIS_URL` (the engine,
/// canary and fault suites run a second time with it set to the Redis Cluster of `.ci/redis-ha`).
pub fn redis_url() -> &'static str {
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(|| {
        std::env::var("TEST_REDIS_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| LOCAL_REDIS.into())
    })
}

/// The script that runs (and reaches into) RabbitMQ 4: `.ci/rabbitmq4 ctl ARGS` is its
/// `rabbitmqctl ARGS`.
pub const RABBITMQ4_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.ci/rabbitmq4");

/// One test's private world: a topology, a Redis key prefix and a replay name, on one broker
/// with one queue type.
pub struct World {
    pub tag: String,
    pub target: Target,
    pub topo: Topology,
    pub conn: Connection,
    pub ch: Channel,
    pub redis: engine::store::Redis,
    pub prefix: String,
}

impl World {
    /// A world on RabbitMQ 3.10 with classic queues.
    pub async fn new(name: &str) -> Self {
        World::on(name, &Target::default()).await
    }

    /// A world on `t`'s broker with `t`'s queue type (the broker's default delivery limit).
    pub async fn on(name: &str, t: &Target) -> Self {
        World::on_with(name, t, |topo| topo).await
    }

    /// [`World::on`], with the topology changed by `shape` before it is declared, e.g.
    /// `|topo| topo.delivery_limit(Some(3))`, or `|topo| topo.dead_letter_by_default_exchange()`
    /// for a DLQ fed through the default exchange (Celery's setup).
    pub async fn on_with(name: &str, t: &Target, shape: impl FnOnce(Topology) -> Topology) -> Self {
        // The target in the tag: cases of one scenario running side by side never share names.
        let tag = format!(
            "t-{name}-{}-{}",
            t.code(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let conn = crate::fixture::connect(&t.broker.amqp, &tag)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", t.broker));
        let ch = conn.create_channel().await.expect("channel");
        let topo = shape(Topology::named(&tag).of_type(t.queue_type));
        topo.declare(&ch)
            .await
            .unwrap_or_else(|e| panic!("topology on {t}: {e}"));
        let redis = store::connect(redis_url()).await.expect("redis");
        Self {
            prefix: format!("{tag}:idem:"),
            tag,
            target: t.clone(),
            topo,
            conn,
            ch,
            redis,
        }
    }

    /// This world's broker URL: the one its manifests name.
    pub fn amqp_url(&self) -> &str {
        &self.target.broker.amqp
    }

    /// A manifest for this world; `extra` is YAML appended under `spec:` (indented 2).
    pub fn manifest(&self, extra: &str) -> DlqReplay {
        let text = format!(
            "apiVersion: replay.dlq.dev/v1alpha1\nkind: DlqReplay\nmetadata: {{name: {tag}, namespace: tests}}\nspec:\n  broker: {{url: \"{amqp}\"}}\n  source: {{queue: {dlq}}}\n  quarantine: {{queue: {q}}}\n  canary: {{enabled: false}}\n{extra}",
            tag = self.tag,
            amqp = self.amqp_url(),
            dlq = self.topo.dlq,
            q = self.topo.quarantine,
        );
        dlq_replay_validate::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    /// The idempotency block used by most tests: key = /id, this world's prefix.
    pub fn idempotency(&self, mode: &str) -> String {
        format!(
            "  idempotency:\n    mode: {mode}\n    key: {{fields: [{{pointer: /id}}], prefix: \"{}\"}}\n",
            self.prefix
        )
    }

    /// The replay of `resource`, with its state, claims and audit trail in the local Redis.
    pub fn replay(&self, resource: &DlqReplay) -> Replay {
        resolve(resource, redis_url())
    }

    pub async fn run(&self, resource: &DlqReplay) -> ReplayStatus {
        run_replay(&self.replay(resource)).await
    }

    /// The replay with its state, claims and audit trail in another Redis.
    pub fn replay_on(&self, resource: &DlqReplay, redis_url: &str) -> Replay {
        resolve(resource, redis_url)
    }

    /// A new connection and channel, after the broker went away and came back.
    pub async fn reopen(&mut self) {
        self.conn = crate::fixture::connect(self.amqp_url(), &self.tag)
            .await
            .expect("broker");
        self.ch = self.conn.create_channel().await.expect("channel");
    }

    pub async fn dead_letter(&self, jobs: Vec<(BasicProperties, Vec<u8>)>) {
        fixture::dead_letter(&self.ch, &self.topo, jobs)
            .await
            .expect("dead letters");
    }

    pub fn key(&self, id: &str) -> String {
        engine::key::key_of(&self.prefix, id)
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

    pub async fn audit(&self, status: &ReplayStatus) -> Vec<store::AuditRow> {
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

    /// Every message of a queue, looked at and put back in place. On a quorum queue each look
    /// is a delivery that counts toward the queue's delivery limit (and adds `x-delivery-count`,
    /// which [`seen`] leaves out): prefer [`World::take`], or [`World::mirror_dlq`] for a
    /// "before" picture of the DLQ.
    ///
    /// The messages are handed back one by one, in the order they came (`basic.nack` with
    /// requeue), not by closing the channel: a quorum queue puts back what a closed channel held
    /// in an order of its own (RabbitMQ 3.10 reordered `l00..l11` as `l00 l09 l10 l11 l01 …`),
    /// while it serves messages handed back explicitly first, in the order handed back. A
    /// classic queue puts each back at its old place either way.
    pub async fn peek(&self, queue: &str) -> Vec<Seen> {
        let ch = self.conn.create_channel().await.unwrap();
        let mut out = Vec::new();
        let mut held = Vec::new();
        while let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            out.push(seen(&m.delivery));
            held.push(m.delivery);
        }
        for d in held {
            d.nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await
            .unwrap();
        }
        // A quorum queue applies the requeues asynchronously; a channel closed before they are
        // applied gets its messages back in another order. Wait until all are ready again.
        for _ in 0..200 {
            if fixture::depth(&self.ch, queue).await.unwrap_or(0) as usize >= out.len() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        ch.close(200, "ok".into()).await.unwrap();
        out
    }

    /// A classic queue bound to the dead-letter exchange beside the DLQ, declared before any
    /// dead letter: it receives a copy of every dead letter (the same x-death headers, in the
    /// same order), so [`World::take`] of it shows what the DLQ held without touching the DLQ.
    /// Returns its name; [`World::cleanup`] deletes it. A topology that dead-letters through the
    /// default exchange ([`Topology::dead_letter_by_default_exchange`]) has no exchange to bind
    /// a mirror to: this panics there.
    pub async fn mirror_dlq(&self) -> String {
        assert!(
            !self.topo.by_default_exchange,
            "mirror_dlq: {} dead-letters through the default exchange, which nothing can be bound to; take a \"before\" picture of the DLQ with World::peek instead",
            self.topo.work
        );
        let name = self.mirror_name();
        self.ch
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .expect("mirror queue");
        self.ch
            .queue_bind(
                name.as_str().into(),
                self.topo.dlx.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("mirror binding");
        name
    }

    fn mirror_name(&self) -> String {
        format!("{}.dlq-mirror", self.tag)
    }

    pub async fn depth(&self, queue: &str) -> u32 {
        fixture::depth(&self.ch, queue).await.unwrap()
    }

    pub async fn cleanup(self) {
        let _ = self.topo.delete(&self.ch).await;
        let _ = self
            .ch
            .queue_delete(self.mirror_name().as_str().into(), Default::default())
            .await;
        let mut r = self.redis.clone();
        for pattern in [
            format!("{}*", self.prefix),
            format!("dlq:*tests/{}*", self.tag),
            // The engine's per-queue keys (`dlq:routes:<broker>/<queue>`, `dlq:moves:...`).
            format!("dlq:*/{}.*", self.tag),
        ] {
            forget_keys(&mut r, &pattern).await;
        }
        let _ = self.conn.close(200, "bye".into()).await;
    }
}

/// Delete the keys matching `pattern` (a test's cleanup; errors are ignored: nothing to clean).
pub async fn forget_keys(r: &mut engine::store::Redis, pattern: &str) {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query_async(r)
        .await
        .unwrap_or_default();
    if !keys.is_empty() {
        let _: Result<(), _> = redis::cmd("DEL").arg(&keys).query_async(r).await;
    }
}

/// A manifest resolved as `dlq-replay run -f` resolves it with `REDIS_URL=redis_url` and no
/// `--amqp-url` (`cli::resolve` of the binary, which this crate cannot depend on): the broker URL
/// from `spec.broker.url`, both URLs checked. Panics when the manifest has no broker URL or a URL
/// is refused. `tests/engine` checks that both agree.
pub fn resolve(resource: &DlqReplay, redis_url: &str) -> Replay {
    let amqp_url = resource
        .spec
        .broker
        .url
        .clone()
        .expect("resolve: spec.broker.url (a test manifest names its broker)");
    dlq_replay_validate::check_url(&amqp_url, &dlq_replay_api::AMQP_SCHEMES)
        .unwrap_or_else(|e| panic!("resolve: broker URL: {e}"));
    dlq_replay_validate::check_url(redis_url, &dlq_replay_api::REDIS_SCHEMES)
        .unwrap_or_else(|e| panic!("resolve: Redis URL: {e}"));
    Replay {
        namespace: resource.namespace_or_default(),
        name: resource.name_or_empty(),
        spec: resource.spec.0.clone(),
        amqp_url,
        redis_url: redis_url.into(),
        uid: None,
    }
}

pub async fn run_replay(replay: &Replay) -> ReplayStatus {
    let (tx, _rx) = tokio::sync::watch::channel(ReplayStatus::default());
    engine::run(replay, &Options::default(), &tx, &CancellationToken::new())
        .await
        .expect("run")
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
