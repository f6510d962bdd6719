//! Test support: real dead letters on the real broker, each test in its own names.
//!
//! The broker-touching tests run as a matrix: {RabbitMQ 3.10 on 127.0.0.1:5672, RabbitMQ 4.x on
//! 127.0.0.1:5673 (`AMQP4_URL`)} × {classic, quorum} queues ([`Target`], [`matrix`], the
//! [`matrix!`] macro). A scenario is `async fn scenario(t: Target)` building its world with
//! [`World::on`]; `matrix!(scenario);` makes one test per case, named e.g.
//! `scenario::classic_3_10`. RabbitMQ 4.x cases are skipped (said once on stderr) when it does not
//! answer, unless `REQUIRE_RABBITMQ4=1`.
#![allow(dead_code)]

pub mod cluster;
pub mod fake_api;
pub mod faults;

use std::collections::BTreeMap;
use std::fmt;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use dlq_replay::api::{DlqReplay, ReplayStatus};
use dlq_replay::cli::{self, Endpoints};
use dlq_replay::engine::{self, message, store, Options, Replay};
pub use dlq_replay::fixture::QueueType;
use dlq_replay::fixture::{self, Topology};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use tokio_util::sync::CancellationToken;

/// RabbitMQ 3.10's AMQP URL (the one `World::new` uses).
pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// RabbitMQ 4.x's AMQP URL unless `AMQP4_URL` says otherwise.
pub const AMQP4: &str = "amqp://guest:guest@127.0.0.1:5673/%2f";
/// RabbitMQ 4.x's management API unless `RABBITMQ4_MGMT` says otherwise.
pub const MANAGEMENT4: &str = "http://127.0.0.1:15673";
pub const REDIS: &str = "redis://127.0.0.1:6379/";

/// The script that runs (and reaches into) RabbitMQ 4: `.ci/rabbitmq4 ctl ARGS` is its
/// `rabbitmqctl ARGS`.
pub const RABBITMQ4_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/rabbitmq4");

/// A RabbitMQ to run tests against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broker {
    /// `3.10` or `4.x`.
    pub name: &'static str,
    /// Its AMQP URL: what the World connects to and puts into manifests.
    pub amqp: String,
    /// Its management API, when it has one the tests may use.
    pub management: Option<String>,
    /// The program and leading arguments that make its `rabbitmqctl`.
    ctl: Vec<String>,
}

impl Broker {
    /// The host's RabbitMQ 3.10 (127.0.0.1:5672, host `rabbitmqctl`).
    pub fn v3_10() -> Self {
        Broker {
            name: "3.10",
            amqp: AMQP.into(),
            management: None,
            ctl: vec!["rabbitmqctl".into()],
        }
    }

    /// RabbitMQ 4.x from `.ci/rabbitmq4` (`AMQP4_URL`, default 127.0.0.1:5673; management
    /// `RABBITMQ4_MGMT`, default 127.0.0.1:15673 — the variables `.ci/rabbitmq4 env` prints;
    /// `rabbitmqctl` through `.ci/rabbitmq4 ctl`).
    pub fn v4() -> Self {
        Broker {
            name: "4.x",
            amqp: std::env::var("AMQP4_URL")
                .ok()
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| AMQP4.into()),
            management: Some(
                std::env::var("RABBITMQ4_MGMT")
                    .ok()
                    .filter(|u| !u.is_empty())
                    .unwrap_or_else(|| MANAGEMENT4.into()),
            ),
            ctl: vec![RABBITMQ4_SCRIPT.into(), "ctl".into()],
        }
    }

    pub fn is_v3_10(&self) -> bool {
        self.name == "3.10"
    }

    /// `rabbitmqctl ARGS` for this broker, to run.
    pub fn ctl(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.ctl[0]);
        cmd.args(&self.ctl[1..]).args(args);
        cmd
    }

    /// What runs its `rabbitmqctl`, for messages: `rabbitmqctl` or `…/.ci/rabbitmq4 ctl`.
    pub fn ctl_program(&self) -> String {
        format!(
            "{} (rabbitmqctl of RabbitMQ {})",
            self.ctl.join(" "),
            self.name
        )
    }

    /// `rabbitmqctl ARGS` for this broker, run to its end; panics with what it printed unless it
    /// succeeded.
    pub fn must_ctl(&self, args: &[&str]) -> std::process::Output {
        let out = self
            .ctl(args)
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", self.ctl_program()));
        assert!(
            out.status.success(),
            "rabbitmqctl {} (RabbitMQ {}): {}",
            args.join(" "),
            self.name,
            output_text(&out)
        );
        out
    }

    /// `host:port` of its AMQP URL.
    pub fn address(&self) -> String {
        let url = url::Url::parse(&self.amqp).expect("broker URL");
        let port = url
            .port()
            .unwrap_or(if url.scheme() == "amqps" { 5671 } else { 5672 });
        format!("{}:{port}", url.host_str().unwrap_or("127.0.0.1"))
    }

    /// Whether it answers AMQP: a TCP connection to its address answers the protocol header
    /// with a frame (a port forwarded to a broker still starting accepts and closes instead).
    /// Asked once per process and broker.
    pub fn answers(&self) -> bool {
        static ASKED: OnceLock<Mutex<BTreeMap<String, bool>>> = OnceLock::new();
        let asked = ASKED.get_or_init(Default::default);
        let address = self.address();
        if let Some(&known) = asked.lock().unwrap().get(&address) {
            return known;
        }
        let answers = amqp_answers(&address);
        asked.lock().unwrap().insert(address, answers);
        answers
    }
}

fn amqp_answers(address: &str) -> bool {
    let Some(addr) = address.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return false;
    };
    let Ok(mut tcp) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return false;
    };
    let _ = tcp.set_read_timeout(Some(Duration::from_secs(5)));
    if tcp.write_all(b"AMQP\x00\x00\x09\x01").is_err() {
        return false;
    }
    // connection.start is a method frame: type 1. (Through TLS this byte is a TLS alert, but a
    // byte at all says something answers.)
    let mut first = [0u8; 1];
    matches!(tcp.read(&mut first), Ok(1))
}

impl fmt::Display for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RabbitMQ {}", self.name)
    }
}

/// One case of the matrix: a broker and the type of the work queue, the DLQ and (quorum) the
/// quarantine queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub broker: Broker,
    pub queue_type: QueueType,
}

impl Target {
    pub fn new(broker: Broker, queue_type: QueueType) -> Self {
        Target { broker, queue_type }
    }

    pub fn classic_3_10() -> Self {
        Target::new(Broker::v3_10(), QueueType::Classic)
    }

    pub fn quorum_3_10() -> Self {
        Target::new(Broker::v3_10(), QueueType::Quorum)
    }

    pub fn classic_4_x() -> Self {
        Target::new(Broker::v4(), QueueType::Classic)
    }

    pub fn quorum_4_x() -> Self {
        Target::new(Broker::v4(), QueueType::Quorum)
    }

    /// All four cases, whether their broker answers or not.
    pub fn all() -> Vec<Target> {
        vec![
            Target::classic_3_10(),
            Target::quorum_3_10(),
            Target::classic_4_x(),
            Target::quorum_4_x(),
        ]
    }

    pub fn is_quorum(&self) -> bool {
        self.queue_type == QueueType::Quorum
    }

    /// Short, for names: `c3`, `q3`, `c4`, `q4`.
    pub fn code(&self) -> String {
        let q = match self.queue_type {
            QueueType::Classic => 'c',
            QueueType::Quorum => 'q',
        };
        let b = if self.broker.is_v3_10() { '3' } else { '4' };
        format!("{q}{b}")
    }

    /// Whether this case can run. RabbitMQ 3.10 is assumed up (`.ci/services`; a test on a
    /// 3.10 that is down fails as it always did). For RabbitMQ 4.x that does not answer: false,
    /// said on stderr (once per test binary, past the test harness's capture), or a panic when
    /// `REQUIRE_RABBITMQ4=1`.
    pub fn available(&self) -> bool {
        if self.broker.is_v3_10() || self.broker.answers() {
            return true;
        }
        let why = format!(
            "RabbitMQ {} not reachable at {}; run .ci/rabbitmq4",
            self.broker.name,
            self.broker.address()
        );
        if std::env::var("REQUIRE_RABBITMQ4").as_deref() == Ok("1") {
            panic!("{why} (REQUIRE_RABBITMQ4=1)");
        }
        static SAID: OnceLock<()> = OnceLock::new();
        SAID.get_or_init(|| {
            let _ = writeln!(
                std::io::stderr(),
                "skipped: {why} (its cases pass without running; REQUIRE_RABBITMQ4=1 makes them fail)"
            );
        });
        eprintln!("skipped: {self}: {why}");
        false
    }
}

impl Default for Target {
    /// RabbitMQ 3.10, classic queues: what `World::new` uses.
    fn default() -> Self {
        Target::classic_3_10()
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.broker, self.queue_type)
    }
}

/// The cases to run: all four, less RabbitMQ 4.x's when it does not answer (see
/// [`Target::available`]).
pub fn matrix() -> Vec<Target> {
    Target::all()
        .into_iter()
        .filter(Target::available)
        .collect()
}

#[allow(unused_macros)]
mod cases {
    // In a module of its own: `use` of the macro here brings no `fn matrix` along.
    /// `matrix!(scenario);` after (or before) `async fn scenario(t: Target)`: a module `scenario`
    /// with one `#[tokio::test]` per case (`classic_3_10`, `quorum_3_10`, `classic_4_x`,
    /// `quorum_4_x`), each running the scenario on its [`Target`] when [`Target::available`].
    /// `matrix!(scenario: classic_3_10, quorum_4_x);` runs only those cases (say why beside it).
    macro_rules! matrix {
        ($scenario:ident) => {
            $crate::support::matrix!($scenario: classic_3_10, quorum_3_10, classic_4_x, quorum_4_x);
        };
        ($scenario:ident: $($case:ident),+ $(,)?) => {
            mod $scenario {
                $(
                    #[tokio::test]
                    async fn $case() {
                        let t = $crate::support::Target::$case();
                        if t.available() {
                            super::$scenario(t).await;
                        }
                    }
                )+
            }
        };
    }
    #[allow(unused_imports)]
    pub(crate) use matrix;
}
#[allow(unused_imports)]
pub(crate) use cases::matrix;

/// One test's private world: a topology, a Redis key prefix and a replay name, on one broker
/// with one queue type.
pub struct World {
    pub tag: String,
    pub target: Target,
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
    /// A world on RabbitMQ 3.10 with classic queues.
    pub async fn new(name: &str) -> Self {
        World::on(name, &Target::default()).await
    }

    /// A world on `t`'s broker with `t`'s queue type (the broker's default delivery limit).
    pub async fn on(name: &str, t: &Target) -> Self {
        World::on_with(name, t, |topo| topo).await
    }

    /// [`World::on`], with the topology changed by `shape` before it is declared, e.g.
    /// `|topo| topo.delivery_limit(Some(3))`.
    pub async fn on_with(name: &str, t: &Target, shape: impl FnOnce(Topology) -> Topology) -> Self {
        // The target in the tag: cases of one scenario running side by side never share names.
        let tag = format!(
            "t-{name}-{}-{}",
            t.code(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let conn = engine::connect_amqp(&t.broker.amqp, &tag)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", t.broker));
        let ch = conn.create_channel().await.expect("channel");
        let topo = shape(Topology::named(&tag).of_type(t.queue_type));
        topo.declare(&ch)
            .await
            .unwrap_or_else(|e| panic!("topology on {t}: {e}"));
        let redis = store::connect(REDIS).await.expect("redis");
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

    pub async fn run(&self, resource: &DlqReplay) -> ReplayStatus {
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
        self.conn = engine::connect_amqp(self.amqp_url(), &self.tag)
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
    /// Returns its name; [`World::cleanup`] deletes it.
    pub async fn mirror_dlq(&self) -> String {
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

pub async fn run_replay(replay: &Replay) -> ReplayStatus {
    let (tx, _rx) = tokio::sync::watch::channel(ReplayStatus::default());
    engine::run(replay, &Options::default(), &tx, &CancellationToken::new())
        .await
        .expect("run")
}

/// The header a quorum queue adds to a message it delivers again (RabbitMQ 3.10 and 4.x).
pub const DELIVERY_COUNT: &str = "x-delivery-count";

/// A delivery as [`Seen`], without `x-delivery-count`: a quorum queue adds that header to every
/// message it hands out again, and raises it each time one is handed back (a [`World::peek`]
/// does so too: basic.get then release). It says how often a message was looked at, not what
/// the message is, so comparisons of what sat in a queue ignore it (in `headers` and `props`
/// alike). Whether the broker dropped a message past its delivery limit shows as the message
/// missing, which comparisons still see. A headers table that held nothing else becomes `None`,
/// as the message carried none before the broker added it.
pub fn seen(d: &Delivery) -> Seen {
    let mut props = d.properties.clone();
    if let Some(h) = d.properties.headers() {
        if h.contains_key(DELIVERY_COUNT) {
            let rest: BTreeMap<_, _> = h
                .inner()
                .iter()
                .filter(|(k, _)| k.as_str() != DELIVERY_COUNT)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            props = if rest.is_empty() {
                clear_headers(props)
            } else {
                props.with_headers(FieldTable::from(rest))
            };
        }
    }
    Seen {
        id: props
            .message_id()
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default(),
        headers: props.headers().clone().unwrap_or_default(),
        props,
        body: d.data.clone(),
    }
}

/// `props` with no headers table at all.
fn clear_headers(props: BasicProperties) -> BasicProperties {
    let mut out = BasicProperties::default();
    macro_rules! copy {
        ($($get:ident => $with:ident),+) => {
            $(if let Some(v) = props.$get() { out = out.$with(v.clone()); })+
        };
    }
    copy!(
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        delivery_mode => with_delivery_mode,
        priority => with_priority,
        correlation_id => with_correlation_id,
        reply_to => with_reply_to,
        expiration => with_expiration,
        message_id => with_message_id,
        timestamp => with_timestamp,
        kind => with_type,
        user_id => with_user_id,
        app_id => with_app_id,
        cluster_id => with_cluster_id
    );
    out
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

pub fn assert_sum(status: &ReplayStatus) {
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
