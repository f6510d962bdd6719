//! Leader election: only the Lease holder drives replays, and the Lease changes hands at once after
//! a release, after its expiry otherwise.

use super::*;

pub(crate) async fn with_two_replicas_only_the_leader_drives_replays(c: &Cluster) {
    let w = World::new("ctl-leader").await;
    w.dead_letter((0..30).map(|i| job(&format!("l{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let replicas: Vec<_> = ["op-a", "op-b"]
        .iter()
        .map(|id| {
            let settings = Settings {
                namespace: c.watch_namespace(),
                instance: id.to_string(),
                status_interval: Duration::from_millis(500),
                ..Settings::default()
            };
            let client = c.client();
            // The Lease in the test's namespace: a real cluster's is shared by concurrent tests.
            let lease_ns = c.ns().to_string();
            tokio::spawn(async move {
                let metrics = dlq_replay::metrics::Metrics::global();
                let shutdown = tokio_util::sync::CancellationToken::new();
                let _ = controller::run_with_leader_election(
                    client, settings, &lease_ns, metrics, shutdown,
                )
                .await;
            })
        })
        .collect();
    let api = replays(c);
    let extra = format!(
        "{}  rate: {{messagesPerSecond: 30}}\n",
        w.idempotency("Claim")
    );
    api.create(
        &PostParams::default(),
        &resource(&w, c.ns(), "lead", &extra),
    )
    .await
    .unwrap();
    let r = wait_for(&api, "lead", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(r.status.unwrap().counts.replayed, 30);
    let target = w.take(&w.topo.work).await;
    assert_eq!(target.len(), 30, "published by both replicas?");
    let lease = c
        .get_json("leases", c.ns(), "dlq-replay-leader")
        .await
        .expect("a Lease");
    let holder = lease["spec"]["holderIdentity"]
        .as_str()
        .unwrap()
        .to_string();
    // The leader's Done event is the last one published.
    let events = events_once(c, |e| reasons(e).iter().any(|r| r == "Done")).await;
    let instances: std::collections::BTreeSet<String> = events
        .iter()
        .filter_map(|e| e["reportingInstance"].as_str().map(String::from))
        .collect();
    assert_eq!(
        instances,
        [holder].into_iter().collect(),
        "events from a replica that does not lead"
    );
    for r in replicas {
        r.abort();
    }
    w.cleanup().await;
}

pub(crate) async fn lease_holder(c: &Cluster) -> Option<String> {
    c.get_json("leases", c.ns(), controller::LEASE)
        .await
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(String::from))
        .filter(|h| !h.is_empty())
}

pub(crate) async fn the_lease_is_taken_at_once_after_a_release_and_after_expiry_otherwise(
    c: &Cluster,
) {
    use dlq_replay::controller::lease::{Elector, LeaseConfig};
    let cfg = |who: &str| LeaseConfig {
        duration: Duration::from_secs(3),
        renew_deadline: Duration::from_secs(2),
        retry: Duration::from_millis(200),
        ..LeaseConfig::new("test-lease", c.ns(), who)
    };
    let mut a = Elector::new(c.client(), cfg("a"));
    let mut b = Elector::new(c.client(), cfg("b"));
    assert!(
        a.try_acquire_or_renew().await.unwrap(),
        "a free Lease is taken"
    );
    assert!(
        !b.try_acquire_or_renew().await.unwrap(),
        "a held Lease is not"
    );
    assert!(a.try_acquire_or_renew().await.unwrap(), "the holder renews");
    assert!(a.release().await.unwrap());
    assert!(
        b.try_acquire_or_renew().await.unwrap(),
        "a released Lease is taken at the next ask"
    );
    assert!(!a.try_acquire_or_renew().await.unwrap());
    // b stops renewing (as a replica that died): a takes over once the Lease expired, on its own
    // clock, and not before.
    let t = Instant::now();
    while !a.try_acquire_or_renew().await.unwrap() {
        assert!(t.elapsed() < Duration::from_secs(10), "never taken over");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        t.elapsed() >= Duration::from_millis(2800),
        "{:?}",
        t.elapsed()
    );
    let lease = c.get_json("leases", c.ns(), "test-lease").await.unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "a");
    assert_eq!(lease["spec"]["leaseTransitions"], 2, "{lease}");
    assert!(!b.try_acquire_or_renew().await.unwrap());
    assert!(b.renewal_overdue());
}
