//! The clusters users run (`crates/testkit/src/ha.rs`): a node of a three-node RabbitMQ 4 cluster
//! lost mid-drain, the Redis master lost behind Sentinel and in a Redis Cluster, at CI sizes
//! (`make faults` runs them at full size). Each row: nothing lost, no key published twice, the
//! replay `Done`.
//!
//! The RabbitMQ scenarios kill nodes of the one cluster, and the Redis ones the one master, so
//! each group runs its cases one after the other (a lock, taken before the servers are looked
//! for: a case finds them whole, each restarts what it killed), beside the other test binaries.

use std::sync::OnceLock;

use dlq_replay_testkit::faults::{self, NodeLoss};
use dlq_replay_testkit::ha::{RabbitCluster, RedisHa};
use dlq_replay_testkit::world::*;
use tokio::sync::Mutex;

/// CI size: messages per scenario, and the replay's rate (the kill lands a quarter in).
const N: usize = 800;
const RATE: u32 = 200;

fn rabbit_lock() -> &'static Mutex<()> {
    static LOCK: OnceLock<Mutex<()>> = OnceLock::new();
    LOCK.get_or_init(|| Mutex::new(()))
}

fn redis_lock() -> &'static Mutex<()> {
    static LOCK: OnceLock<Mutex<()>> = OnceLock::new();
    LOCK.get_or_init(|| Mutex::new(()))
}

async fn node_lost(name: &str, loss: NodeLoss) {
    let _one_at_a_time = rabbit_lock().lock().await;
    let Some(cluster) = RabbitCluster::get() else {
        return;
    };
    let mut w = World::on(name, &RabbitCluster::target(&[1, 2, 3])).await;
    let t = faults::rabbit_node_lost(&mut w, cluster, loss, "Claim", N, RATE).await;
    t.assert_ok();
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_node_is_killed_goes_on_through_another_and_ends_done() {
    node_lost("node-lost", NodeLoss::Connected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_dlq_leader_is_killed_keeps_every_message_and_ends_done() {
    node_lost("leader-lost", NodeLoss::Leader).await;
}

async fn master_lost(name: &str, ha: RedisHa, mode: &'static str) {
    let _one_at_a_time = redis_lock().lock().await;
    let Some(ha) = ha.get() else {
        return;
    };
    let w = World::on(name, &Target::classic_3_10()).await;
    let t = faults::redis_master_lost(&w, ha, mode, N, RATE).await;
    t.assert_ok();
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_mid_drain_in_claim_mode_loses_no_claim() {
    master_lost("sentinel-claim", RedisHa::Sentinel, "Claim").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_mid_drain_in_check_mode_loses_nothing() {
    master_lost("sentinel-check", RedisHa::Sentinel, "Check").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_master_killed_mid_drain_loses_no_claim() {
    master_lost("cluster-claim", RedisHa::Cluster, "Claim").await;
}

/// A batch's outcome that fewer replicas hold than `?replicas=` asks for is not relied on: the
/// commit fails (at once here: no retry budget) rather than let its messages be acked on a write
/// a failover could lose. With as many replicas as there are, it goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_fewer_replicas_hold_than_asked_for_is_not_relied_on() {
    use dlq_replay::engine::status::Counts;
    use dlq_replay::engine::store::{self, AuditConfig, AuditRow, Store};
    let _one_at_a_time = redis_lock().lock().await;
    for ha in [RedisHa::Sentinel, RedisHa::Cluster] {
        let Some(ha) = ha.get() else {
            continue;
        };
        // Two replicas behind Sentinel, one per master in the Cluster.
        let (have, url) = match ha {
            RedisHa::Sentinel => (2, ha.url()),
            RedisHa::Cluster => (1, ha.url()),
        };
        let name = format!("replicas-{}", uuid::Uuid::new_v4().simple());
        let row = AuditRow {
            message: "m1".into(),
            decision: "replayed".into(),
            ..Default::default()
        };
        for (asked, ok) in [(have + 1, false), (have, true)] {
            let con = store::connect(&format!("{url}?replicas={asked}"))
                .await
                .unwrap();
            assert_eq!(con.replicas(), asked);
            let (mut s, _) = Store::begin(con, "tests", &name, 0, "now", &AuditConfig::default())
                .await
                .unwrap();
            let done = s
                .commit(
                    std::slice::from_ref(&row),
                    &[("m1".into(), "replayed".into())],
                    &[],
                    &Counts::default(),
                )
                .await;
            match (ok, done) {
                (true, Ok(_)) => {}
                (false, Err(e)) => assert!(
                    e.to_string()
                        .contains(&format!("reached {have} of the {asked} replicas")),
                    "{ha:?}: {e}"
                ),
                (ok, done) => panic!("{ha:?}, replicas={asked}: expected ok={ok}, got {done:?}"),
            }
            let keys = s.keys().clone();
            let mut r = s.redis();
            let _: () = redis::cmd("DEL")
                .arg(keys.all().as_slice())
                .query_async(&mut r)
                .await
                .unwrap();
        }
    }
}
