//! The operator on clustered servers: the Secrets hold a three-node RabbitMQ's endpoints and a
//! Redis Sentinel group's, and the replay runs to Done through them (skipped, and said so, when
//! `.ci/rabbitmq4-cluster` or `.ci/redis-ha` has none up, unless `REQUIRE_CLUSTERS=1`).

use super::*;
use dlq_replay_testkit::ha::{RabbitCluster, RedisHa};

pub(crate) async fn a_replay_through_clustered_servers_named_in_its_secrets_runs_to_done(
    c: &Cluster,
) {
    let (Some(_), Some(sentinel)) = (RabbitCluster::get(), RedisHa::Sentinel.get()) else {
        return;
    };
    let w = World::on("ctl-ha", &RabbitCluster::target(&[1, 2, 3])).await;
    let jobs: Vec<_> = (0..20).map(|i| job(&format!("j{i}"), json!({}))).collect();
    w.dead_letter(jobs).await;
    // The replay lists node 2 first: whichever node answers, the queues are the cluster's.
    c.put_secret(
        c.ns(),
        "rabbitmq",
        &[("url", &RabbitCluster::url(&[2, 3, 1]))],
    )
    .await;
    c.put_secret(c.ns(), "redis", &[("url", &sentinel.url())])
        .await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let extra = format!(
        "{}    redis: {{urlSecretRef: {{name: redis, key: url}}}}\n",
        w.idempotency("Claim")
    );
    api.create(&PostParams::default(), &resource(&w, c.ns(), "ha", &extra))
        .await
        .unwrap();
    let r = wait_for(&api, "ha", "Done", |r| phase(r) == Some(Phase::Done)).await;
    let s = r.status.clone().unwrap();
    assert_eq!(s.counts.replayed, 20, "{s:?}");
    assert_eq!(w.depth(&w.topo.work).await, 20);
    // The claims are on the Sentinel group's master, marked published.
    let mut redis = dlq_replay::engine::store::connect(&sentinel.url())
        .await
        .unwrap();
    let claim: Option<String> = redis::cmd("GET")
        .arg(w.key("j7"))
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(
        claim.as_deref().is_some_and(|v| v.ends_with("+published")),
        "{claim:?}"
    );
    for pattern in [format!("*{}*", c.ns()), format!("{}*", w.prefix)] {
        forget_keys(&mut redis, &pattern).await;
    }
    w.cleanup().await;
}
