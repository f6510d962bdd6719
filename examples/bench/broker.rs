//! The RabbitMQs the bench runs against, the throughput sections on them, and their Shovel plugin.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use dlq_replay::fixture::QueueType;
use lapin::Connection;

use crate::costs::cmd_out;

/// A RabbitMQ the bench runs against.
pub(crate) struct Broker {
    /// `3.10` or `4`, as BENCH_BROKERS names it; in labels.
    pub(crate) name: &'static str,
    pub(crate) amqp: String,
    pub(crate) conn: Connection,
    /// The program and leading arguments that make its `rabbitmqctl`.
    pub(crate) ctl: Vec<String>,
    /// The URI the Shovel (inside the broker) connects to, for its source and destination.
    pub(crate) shovel_uri: String,
    /// The RabbitMQ node (beam.smp), for its CPU time.
    pub(crate) pid: Option<u32>,
    pub(crate) version: String,
}

impl Broker {
    /// `rabbitmqctl ARGS` of this broker, to spawn.
    pub(crate) fn ctl(&self, args: &[&str]) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(&self.ctl[0]);
        c.args(&self.ctl[1..]).args(args);
        c
    }

    /// `rabbitmqctl ARGS` run to its end: its stdout (empty if it failed to start).
    pub(crate) fn ctl_out(&self, args: &[&str]) -> String {
        let all: Vec<&str> = self.ctl[1..]
            .iter()
            .map(String::as_str)
            .chain(args.iter().copied())
            .collect();
        cmd_out(&self.ctl[0], &all)
    }
}

/// One throughput section: a broker and the type of every queue of its runs.
#[derive(Debug, Clone)]
pub(crate) struct Section {
    /// Index into `Bench::brokers`.
    pub(crate) broker: usize,
    pub(crate) queue_type: QueueType,
    /// e.g. `quorum DLQ (RabbitMQ 3.10)`.
    pub(crate) label: String,
    /// Prepended to scenario names (empty for classic on 3.10, which keeps its old names).
    pub(crate) tag: String,
}

impl Section {
    /// RabbitMQ 3.10, classic queues: the rate-accuracy and memory runs.
    pub(crate) fn classic_3_10() -> Self {
        Section::new(0, "3.10", QueueType::Classic)
    }

    pub(crate) fn new(broker: usize, broker_name: &str, queue_type: QueueType) -> Self {
        let tag = if broker == 0 && queue_type == QueueType::Classic {
            String::new()
        } else {
            let q = match queue_type {
                QueueType::Classic => 'c',
                QueueType::Quorum => 'q',
            };
            format!("{q}{}-", broker_name.split('.').next().unwrap_or("x"))
        };
        Section {
            broker,
            queue_type,
            label: format!("{queue_type} DLQ (RabbitMQ {broker_name})"),
            tag,
        }
    }

    /// `, quorum DLQ (RabbitMQ 3.10)` in progress lines, nothing for the classic 3.10 runs.
    pub(crate) fn note(&self) -> String {
        if self.tag.is_empty() {
            String::new()
        } else {
            format!(", {}", self.label)
        }
    }
}

/// The Shovel plugin on `broker`: enabled with rabbitmq-plugins on RabbitMQ 3.10; on RabbitMQ 4
/// (`.ci/rabbitmq4` enables it at boot, and its CLI is rabbitmqctl only) checked.
pub(crate) fn enable_shovel(broker: &Broker) {
    if broker.name != "3.10" {
        let running = broker.ctl_out(&[
            "-q",
            "eval",
            "lists:keymember(rabbitmq_shovel, 1, application:which_applications()).",
        ]);
        if running.trim() != "true" {
            eprintln!(
                "bench: rabbitmq_shovel is not running on RabbitMQ {} ({}: {:?}); .ci/rabbitmq4 enables it at boot",
                broker.name,
                broker.ctl.join(" "),
                running.trim()
            );
            std::process::exit(2);
        }
        println!("rabbitmq_shovel on RabbitMQ {}: running", broker.name);
        return;
    }
    let enabled = cmd_out("rabbitmq-plugins", &["-q", "list", "-e", "-m"]);
    if enabled.lines().any(|l| l.trim() == "rabbitmq_shovel") {
        println!("rabbitmq_shovel: already enabled");
        return;
    }
    let t = Instant::now();
    let st = std::process::Command::new("rabbitmq-plugins")
        .args(["-q", "enable", "rabbitmq_shovel"])
        .stdout(Stdio::null())
        .status()
        .expect("rabbitmq-plugins");
    assert!(
        st.success(),
        "rabbitmq-plugins enable rabbitmq_shovel failed"
    );
    println!(
        "rabbitmq_shovel: enabled now ({:.1}s)",
        t.elapsed().as_secs_f64()
    );
}

impl Broker {
    /// RabbitMQ 4 at AMQP4_URL, its rabbitmqctl through `.ci/rabbitmq4 ctl`; Err says why not.
    pub(crate) async fn v4() -> Result<Self, String> {
        let amqp = std::env::var("AMQP4_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5673/%2f".into());
        let at = address(&amqp);
        let conn = match tokio::time::timeout(
            Duration::from_secs(10),
            dlq_replay::fixture::connect(&amqp, "dlq-replay bench"),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(format!("{at} does not answer ({e})")),
            Err(_) => return Err(format!("{at} does not answer within 10 s")),
        };
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/rabbitmq4");
        let mut b = Broker {
            name: "4",
            // The Shovel runs inside the node, which shares this host's network.
            shovel_uri: amqp.clone(),
            amqp,
            conn,
            ctl: vec![script.display().to_string(), "ctl".into()],
            pid: None,
            version: String::new(),
        };
        b.version = b.ctl_out(&["-q", "version"]).trim().to_string();
        if !b.version.starts_with('4') {
            return Err(format!(
                "its rabbitmqctl ({}) reports version {:?}",
                b.ctl.join(" "),
                b.version
            ));
        }
        b.pid = node_pid(&b);
        Ok(b)
    }
}

/// The OS pid of the broker's node, as its rabbitmqctl tells it.
pub(crate) fn node_pid(b: &Broker) -> Option<u32> {
    b.ctl_out(&["-q", "eval", "os:getpid()."])
        .trim()
        .trim_matches('"')
        .parse()
        .ok()
}

/// `host:port` of an AMQP URL, without its credentials.
pub(crate) fn address(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(u) => format!(
            "{}:{}",
            u.host_str().unwrap_or("?"),
            u.port().unwrap_or(5672)
        ),
        Err(_) => "?".into(),
    }
}
