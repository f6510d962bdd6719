//! The operator refuses a spec the CRD's rules refuse, when an API server admitted it anyway (an
//! older CRD was installed when it was created): the replay ends `Failed`, reason `InvalidSpec`,
//! naming the fields, with its Degraded condition and a Warning event, and nothing is touched on
//! the broker (none listens at the replay's broker URL: any attempt would leave it `Pending`,
//! `Unavailable`).
//!
//! Runs against the in-process fake API server only: making a real one admit an invalid replay
//! means installing an older CRD, which would disturb every other test of that cluster.

use std::time::Duration;

use dlq_replay::api::{DlqReplay, Phase};
use dlq_replay::controller::{self, Settings};
use dlq_replay_testkit::fake_api::{committed_crd, crd_before_the_rules, FakeApi};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::json;

const NS: &str = "media";

async fn apply_crd(fake: &FakeApi, crd: CustomResourceDefinition) {
    let name = crd.metadata.name.clone().expect("CRD name");
    Api::<CustomResourceDefinition>::all(fake.client())
        .patch(
            &name,
            &PatchParams::apply("dlq-replay-tests").force(),
            &Patch::Apply(crd),
        )
        .await
        .expect("apply the CRD");
}

#[tokio::test]
async fn a_spec_an_older_crd_admitted_ends_failed_invalid_spec_without_touching_the_broker() {
    let fake = FakeApi::start().await;
    apply_crd(&fake, crd_before_the_rules()).await;
    // Nothing listens on port 1: the broker and Redis are out of reach.
    let replay: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "replay.dlq.dev/v1alpha1",
        "kind": "DlqReplay",
        "metadata": {"name": "bad", "namespace": NS},
        "spec": {
            "broker": {"url": "amqp://guest:guest@127.0.0.1:1/%2f"},
            "source": {"queue": "media.dlq"},
            "quarantine": {"queue": "media.dlq"},
            "idempotency": {
                "redis": {"url": "redis://127.0.0.1:1/0"},
                "key": {"fields": [{"pointer": "asset_id"}]},
            },
            "rate": {"messagesPerSecond": 0},
            "canary": {"waitSeconds": 0},
        },
    }))
    .unwrap();
    let raw: Api<DynamicObject> =
        Api::namespaced_with(fake.client(), NS, &ApiResource::erase::<DlqReplay>(&()));
    raw.create(&PostParams::default(), &replay)
        .await
        .expect("admitted by the older CRD");
    apply_crd(&fake, committed_crd()).await;

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let settings = Settings {
        namespace: Some(NS.into()),
        instance: "invalid-spec-test".into(),
        ..Settings::default()
    };
    let operator = tokio::spawn(controller::run_until(fake.client(), settings, async {
        let _ = stop_rx.await;
    }));

    let api: Api<DlqReplay> = Api::namespaced(fake.client(), NS);
    let mut status = None;
    for _ in 0..150 {
        let r = api.get("bad").await.unwrap();
        if r.status.as_ref().and_then(|s| s.phase).is_some() {
            status = r.status;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = status.expect("the operator wrote no status");
    let message = status.message.clone().unwrap_or_default();
    eprintln!("status.message: {message}");
    assert_eq!(status.phase, Some(Phase::Failed), "{status:?}");
    assert!(message.starts_with("InvalidSpec: "), "{message}");
    for field in [
        "spec.rate.messagesPerSecond",
        "spec.quarantine.queue",
        "spec.idempotency.key.fields[0].pointer",
        "spec.canary.waitSeconds",
    ] {
        assert!(message.contains(field), "{field} not named: {message}");
    }
    assert!(!message.contains("guest:guest"), "{message}");
    let degraded = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .expect("a Degraded condition");
    assert_eq!(
        (degraded.status.as_str(), degraded.reason.as_str()),
        ("True", "InvalidSpec")
    );
    assert!(status.finished_at.is_some());
    // Nothing was started: no replay id, no depth, no counts.
    assert!(status.replay_id.is_none() && status.source_depth_at_start.is_none());
    assert_eq!(status.counts, Default::default());
    // It stays so: a later reconcile neither rewrites nor starts it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let again = api.get("bad").await.unwrap().status.unwrap();
    assert_eq!(again.phase, Some(Phase::Failed));
    assert_eq!(again.message, status.message);
    let events = fake.events();
    assert!(
        events.iter().any(|e| e["reason"] == "Failed"
            && e["type"] == "Warning"
            && e["note"]
                .as_str()
                .is_some_and(|n| n.starts_with("InvalidSpec"))),
        "{events:#?}"
    );
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(10), operator)
        .await
        .expect("the operator stops")
        .expect("operator task")
        .expect("operator");
}
