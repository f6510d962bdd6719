//! The clustered servers users run, for the tests that need them: a three-node RabbitMQ 4
//! cluster (`.ci/rabbitmq4-cluster`), a Redis Sentinel group and a Redis Cluster
//! (`.ci/redis-ha`). Each is found by its well-known ports; a test that finds one missing skips,
//! and says so, unless `REQUIRE_CLUSTERS=1` (CI), which makes it fail.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::world::{must, Broker, QueueType, Target};

/// The script that runs the three-node RabbitMQ 4 cluster.
pub const RABBITMQ_CLUSTER_SCRIPT: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../.ci/rabbitmq4-cluster");
/// The script that runs the Redis Sentinel group and the Redis Cluster.
pub const REDIS_HA_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.ci/redis-ha");

/// The cluster nodes' AMQP ports (node 1, 2, 3).
const AMQP_PORTS: [u16; 3] = [5681, 5682, 5683];
/// The cluster nodes' management ports.
const MGMT_PORTS: [u16; 3] = [15681, 15682, 15683];
/// The Sentinel group: its sentinels, and its master's name.
const SENTINEL_PORTS: [u16; 3] = [26390, 26391, 26392];
const SENTINEL_MASTER: &str = "dlq-replay";
/// The Redis Cluster's nodes (three masters and their replicas).
const CLUSTER_PORTS: [u16; 6] = [7100, 7101, 7102, 7103, 7104, 7105];

fn listening(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
}

/// Whether the setup `what` answers on `ports`; if not, a skip said on stderr, or a panic under
/// `REQUIRE_CLUSTERS=1`.
fn present(what: &str, ports: &[u16], script: &str) -> bool {
    if ports.iter().all(|&p| listening(p)) {
        return true;
    }
    let why = format!("{what} not up on 127.0.0.1:{ports:?}; run {script} up");
    if std::env::var("REQUIRE_CLUSTERS").as_deref() == Ok("1") {
        panic!("{why} (REQUIRE_CLUSTERS=1)");
    }
    eprintln!("skipped: {why} (REQUIRE_CLUSTERS=1 makes this fail)");
    false
}

/// Run `program args` and return what it printed on stdout, panicking with all it printed
/// unless it succeeded.
fn run(program: &str, args: &[&str]) -> String {
    String::from_utf8_lossy(&must(program, args).stdout)
        .trim()
        .to_string()
}

/// The three-node RabbitMQ 4 cluster. Nodes are numbered 1 to 3.
#[derive(Debug, Clone, Copy)]
pub struct RabbitCluster;

impl RabbitCluster {
    /// The cluster, if it is up (see the module's doc for what happens when it is not).
    pub fn get() -> Option<Self> {
        present("the RabbitMQ cluster", &AMQP_PORTS, RABBITMQ_CLUSTER_SCRIPT)
            .then_some(RabbitCluster)
    }

    /// The AMQP URL of one node.
    pub fn node_url(node: usize) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", AMQP_PORTS[node - 1])
    }

    /// The cluster's URL listing the nodes in `order` (a client tries them in that order): one
    /// URL with several hosts, as a user would write it.
    pub fn url(order: &[usize]) -> String {
        let hosts: Vec<String> = order
            .iter()
            .map(|n| format!("127.0.0.1:{}", AMQP_PORTS[n - 1]))
            .collect();
        format!("amqp://guest:guest@{}/%2f", hosts.join(","))
    }

    /// A test target on the cluster with quorum queues, reached through the nodes in `order`
    /// (the world's own connection, and its manifests' broker URL). Its `rabbitmqctl` and
    /// management API are those of the first node in `order`.
    pub fn target(order: &[usize]) -> Target {
        let first = order[0];
        Target {
            broker: Broker::other(
                "4.x cluster",
                Self::url(order),
                Some(format!("http://127.0.0.1:{}", MGMT_PORTS[first - 1])),
                vec![
                    RABBITMQ_CLUSTER_SCRIPT.into(),
                    "ctl".into(),
                    first.to_string(),
                ],
            ),
            queue_type: QueueType::Quorum,
        }
    }

    /// `kill -9` of a node; returns once its AMQP port is closed.
    pub fn kill(self, node: usize) {
        run(RABBITMQ_CLUSTER_SCRIPT, &["kill", &node.to_string()]);
    }

    /// Start a node again and wait until it is back in the cluster.
    pub fn start(self, node: usize) {
        run(RABBITMQ_CLUSTER_SCRIPT, &["start", &node.to_string()]);
    }

    /// The node that leads the quorum queue `queue` now.
    pub fn leader(self, queue: &str) -> usize {
        let out = run(RABBITMQ_CLUSTER_SCRIPT, &["leader", queue]);
        out.parse()
            .unwrap_or_else(|_| panic!("leader of {queue}: {out:?}"))
    }

    /// Whether a node's AMQP port accepts connections.
    pub fn is_up(self, node: usize) -> bool {
        listening(AMQP_PORTS[node - 1])
    }

    /// Start every node that is down (a test that failed half-way leaves none behind).
    pub fn heal(self) {
        for node in 1..=3 {
            if !self.is_up(node) {
                self.start(node);
            }
        }
    }
}

/// Which Redis setup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisHa {
    /// A master and two replicas behind three sentinels.
    Sentinel,
    /// Three masters, each with a replica.
    Cluster,
}

impl RedisHa {
    /// The setup, if it is up.
    pub fn get(self) -> Option<Self> {
        let (what, ports): (&str, &[u16]) = match self {
            RedisHa::Sentinel => ("the Redis Sentinel group", &SENTINEL_PORTS),
            RedisHa::Cluster => ("the Redis Cluster", &CLUSTER_PORTS[..3]),
        };
        present(what, ports, REDIS_HA_SCRIPT).then_some(self)
    }

    fn name(self) -> &'static str {
        match self {
            RedisHa::Sentinel => "sentinel",
            RedisHa::Cluster => "cluster",
        }
    }

    /// The URL a replay names it by.
    pub fn url(self) -> String {
        let hosts = |ports: &[u16]| {
            ports
                .iter()
                .map(|p| format!("127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            RedisHa::Sentinel => format!(
                "redis+sentinel://{}/{SENTINEL_MASTER}",
                hosts(&SENTINEL_PORTS)
            ),
            RedisHa::Cluster => format!("redis+cluster://{}", hosts(&CLUSTER_PORTS[..3])),
        }
    }

    /// `kill -9` of the master (Sentinel), or of the master that owns `key`'s slot (Cluster);
    /// returns its port.
    pub fn kill_master(self, key: &str) -> u16 {
        let mut args = vec!["kill-master", self.name()];
        if self == RedisHa::Cluster {
            args.push(key);
        }
        let out = run(REDIS_HA_SCRIPT, &args);
        out.lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("kill-master printed no port: {out:?}"))
    }

    /// Wait until a new master serves writes; returns how long that took from now.
    pub fn wait_failover(self) -> Duration {
        let start = Instant::now();
        run(REDIS_HA_SCRIPT, &["wait-failover", self.name()]);
        start.elapsed()
    }

    /// Start a killed node again (it comes back as a replica).
    pub fn restart(self, port: u16) {
        run(REDIS_HA_SCRIPT, &["restart", &port.to_string()]);
    }
}
