//! Faults of clustered servers: a RabbitMQ node lost mid-drain (the one the replay is connected
//! to, or the one leading the DLQ's quorum queue), the Redis master lost behind Sentinel or in a
//! Redis Cluster. The servers come from [`crate::ha`]; each row also gives the time from the kill
//! to the first message replayed after it.

use super::*;
use crate::ha::{RabbitCluster, RedisHa};

/// Which RabbitMQ node a scenario kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeLoss {
    /// The node the replay's connections go through (not the DLQ's leader).
    Connected,
    /// The node that leads the DLQ's quorum queue (the replay is connected to another).
    Leader,
}

/// How long from now (call it once the killed node is gone) until the replay has replayed more
/// than it had plus the in-flight window (what was published before the kill may still be
/// recorded after it): the first message published after the kill. `None` if that does not
/// happen within `give_up`.
async fn next_replayed(
    mut progress: tokio::sync::watch::Receiver<ReplayStatus>,
    give_up: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    let past = progress.borrow_and_update().counts.replayed + engine::DEFAULT_WINDOW as u64;
    let wait = async {
        loop {
            if progress.borrow_and_update().counts.replayed > past {
                return start.elapsed();
            }
            if progress.changed().await.is_err() {
                return start.elapsed();
            }
        }
    };
    tokio::time::timeout(give_up, wait).await.ok()
}

/// Run a script (a kill, a wait) off the runtime's threads: the replay runs on them meanwhile.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

/// A RabbitMQ node lost (`kill -9`) mid-drain, on the three-node cluster, DLQ and target quorum
/// queues. The world (`RabbitCluster::target`) reaches the cluster through node 1, so its queues
/// are led by node 1; the replay lists another node first. The replay must end `Done` on the
/// nodes that are left; the killed node is started again afterwards.
pub async fn rabbit_node_lost(
    w: &mut World,
    cluster: RabbitCluster,
    loss: NodeLoss,
    mode: &'static str,
    n: usize,
    rate: u32,
) -> Tally {
    let leader = cluster.leader(&w.topo.dlq);
    // The replay goes through the node after the leader first, then the others.
    let through = leader % 3 + 1;
    let order: Vec<usize> = (0..3).map(|i| (through - 1 + i) % 3 + 1).collect();
    let killed = match loss {
        NodeLoss::Connected => through,
        NodeLoss::Leader => leader,
    };
    let (task, progress) =
        drain_through(w, mode, n, rate, &RabbitCluster::url(&order), redis_url()).await;
    until_depth(w, &w.topo.work, n / 4, Duration::from_secs(120)).await;
    blocking(move || cluster.kill(killed)).await;
    // Started again however the scenario ends (a failed assertion included), for the next one.
    let _revive = Revive(move || cluster.start(killed));
    let next = tokio::spawn(next_replayed(progress, Duration::from_secs(120)));
    let mut problems = Vec::new();
    let status = ended(task, &mut problems).await;
    let next = next.await.ok().flatten();
    let leader_after = cluster.leader(&w.topo.dlq);
    if killed == 1 {
        // The world's own connection went with node 1.
        w.reopen().await;
    }
    if loss == NodeLoss::Leader && leader_after == killed {
        problems.push(format!(
            "node {killed} was killed and still leads {}",
            w.topo.dlq
        ));
    }
    let fault = match loss {
        NodeLoss::Connected => "rabbitmq: kill -9 of the replay's node",
        NodeLoss::Leader => "rabbitmq: kill -9 of the DLQ's leader",
    };
    finish_on(
        w,
        redis_url(),
        &w.topo.work.clone(),
        fault,
        mode,
        n,
        1,
        &status,
        &mut problems,
        |p, problems| {
            // The DLQ's order survives its leader's change: with the replay's connection intact
            // nothing is handed back, so the target holds the messages in the DLQ's order.
            // (A lost connection hands its unacked messages back, which a RabbitMQ 4 quorum
            // queue puts behind the rest: not checked then.)
            let ordered = p.target_order.windows(2).all(|w| w[0] < w[1]);
            if loss == NodeLoss::Leader && !ordered {
                problems.push("the target's messages are not in the DLQ's order".into());
            }
            format!(
                "killed node {killed} (replay through {through}, DLQ led by {leader}, then {leader_after}); next replayed {}; {} OutcomeUnknown",
                after_kill(next),
                p.unknown()
            )
        },
    )
    .await
}

/// Runs its closure when dropped: what a scenario killed is started again even when it fails.
struct Revive<F: FnMut()>(F);

impl<F: FnMut()> Drop for Revive<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// The Redis master lost (`kill -9`) mid-drain: behind Sentinel (the sentinels promote a
/// replica), or in a Redis Cluster (the master holding the replay's keys; its replica takes
/// over). Claims and outcomes are written to a replica before they are relied on (`WAIT`), so
/// the failover costs no outcome: nothing is quarantined `OutcomeUnknown`, no key is published
/// twice. The killed node is started again (as a replica) once the failover is done.
pub async fn redis_master_lost(
    w: &World,
    ha: RedisHa,
    mode: &'static str,
    n: usize,
    rate: u32,
) -> Tally {
    let url = ha.url();
    let (task, progress) = drain_through(w, mode, n, rate, w.amqp_url(), &url).await;
    until_depth(w, &w.topo.work, n / 4, Duration::from_secs(120)).await;
    let state = store::Keys::state_of(store::Layout::Tagged, "tests", &w.tag);
    let port = blocking(move || ha.kill_master(&state)).await;
    let next = tokio::spawn(next_replayed(progress, Duration::from_secs(120)));
    let failover = blocking(move || ha.wait_failover()).await;
    // The killed master comes back as a replica, so that the group or shard has its replicas
    // again (a `WAIT` for one would stall without).
    blocking(move || ha.restart(port)).await;
    let mut problems = Vec::new();
    let status = ended(task, &mut problems).await;
    let next = next.await.ok().flatten();
    let fault = match ha {
        RedisHa::Sentinel => "redis: sentinel failover (kill -9 master)",
        RedisHa::Cluster => "redis: cluster master kill -9",
    };
    let tally = finish_on(
        w,
        &url,
        &w.topo.work.clone(),
        fault,
        mode,
        n,
        1,
        &status,
        &mut problems,
        |p, problems| {
            no_unknown_after_redis_came_back(p, problems);
            format!(
                "killed :{port}; new master in {:.1}s; next replayed {}; {} OutcomeUnknown",
                failover.as_secs_f64(),
                after_kill(next),
                p.unknown()
            )
        },
    )
    .await;
    forget(&url, &w.tag).await;
    tally
}

/// Delete the keys of the world tagged `tag` from the Redis at `url` (the world's cleanup knows
/// its own Redis only).
async fn forget(url: &str, tag: &str) {
    if let Ok(mut r) = store::connect(url).await {
        forget_keys(&mut r, &format!("*{tag}*")).await;
    }
}

/// "N.Ns after the kill", or "never" (`next_replayed` gave up).
fn after_kill(next: Option<Duration>) -> String {
    next.map_or("never".to_string(), |d| {
        format!("{:.1}s after the kill", d.as_secs_f64())
    })
}
