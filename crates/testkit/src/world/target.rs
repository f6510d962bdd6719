//! The brokers the tests run against, and the matrix of cases: {RabbitMQ 3.10, RabbitMQ 4.x} ×
//! {classic, quorum} queues.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use super::{output_text, QueueType, AMQP, AMQP4, MANAGEMENT4, RABBITMQ4_SCRIPT};

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

    /// Another RabbitMQ (a cluster: `crate::ha`), with what makes its `rabbitmqctl`.
    pub fn other(
        name: &'static str,
        amqp: String,
        management: Option<String>,
        ctl: Vec<String>,
    ) -> Self {
        Broker {
            name,
            amqp,
            management,
            ctl,
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

    /// `host:port` of its AMQP URL (its first endpoint's, for a cluster).
    pub fn address(&self) -> String {
        let first = dlq_replay_engine::endpoints::first(&self.amqp);
        let url = url::Url::parse(&first).expect("broker URL");
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

/// `matrix!(scenario);` after (or before) `async fn scenario(t: Target)`: a module `scenario`
/// with one `#[tokio::test]` per case (`classic_3_10`, `quorum_3_10`, `classic_4_x`,
/// `quorum_4_x`), each running the scenario on its [`Target`] when [`Target::available`].
/// `matrix!(scenario: classic_3_10, quorum_4_x);` runs only those cases (say why beside it).
///
/// [`Target`]: crate::world::Target
/// [`Target::available`]: crate::world::Target::available
#[macro_export]
macro_rules! matrix {
    ($scenario:ident) => {
        $crate::matrix!($scenario: classic_3_10, quorum_3_10, classic_4_x, quorum_4_x);
    };
    ($scenario:ident: $($case:ident),+ $(,)?) => {
        mod $scenario {
            $(
                #[tokio::test]
                async fn $case() {
                    let t = $crate::world::Target::$case();
                    if t.available() {
                        super::$scenario(t).await;
                    }
                }
            )+
        }
    };
}
