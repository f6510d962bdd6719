//! The built-in kinds the operator uses: Secrets, Leases, Events (core/v1 and events.k8s.io/v1).

use super::*;

pub(crate) async fn secrets_and_leases(env: &Env) {
    let secrets = env.secrets();
    let s: Secret = serde_json::from_value(json!({
        "metadata": {"name": "creds", "labels": {"app": "dlq"}},
        "stringData": {"url": "amqp://u:p@h:5672/%2f"},
    }))
    .unwrap();
    secrets.create(&PostParams::default(), &s).await.unwrap();
    let got = secrets.get("creds").await.unwrap();
    assert_eq!(
        got.data.as_ref().unwrap()["url"].0,
        b"amqp://u:p@h:5672/%2f"
    );
    assert!(got.string_data.is_none(), "stringData is folded into data");
    let listed = secrets
        .list(&ListParams::default().labels("app=dlq"))
        .await
        .unwrap();
    assert_eq!(
        listed
            .items
            .iter()
            .map(|s| s.name_any())
            .collect::<Vec<_>>(),
        ["creds"]
    );
    let none = secrets
        .list(&ListParams::default().labels("app=other"))
        .await
        .unwrap();
    assert!(none.items.is_empty());

    let leases = env.leases();
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "leader"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15},
    }))
    .unwrap();
    let l1 = leases.create(&PostParams::default(), &lease).await.unwrap();
    let mut take = l1.clone();
    take.spec.as_mut().unwrap().holder_identity = Some("b".into());
    let l2 = leases
        .replace("leader", &PostParams::default(), &take)
        .await
        .unwrap();
    assert_eq!(
        l2.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("b")
    );
    let mut late = l1.clone();
    late.spec.as_mut().unwrap().holder_identity = Some("c".into());
    let e = leases
        .replace("leader", &PostParams::default(), &late)
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 409, "a stale lease update must conflict");
}

pub(crate) async fn events_in_both_groups(env: &Env) {
    let api = env.replays();
    let r = api
        .create(&PostParams::default(), &replay("ev", &env.ns))
        .await
        .unwrap();
    let reference: ObjectReference = r.object_ref(&());
    let recorder =
        kube::runtime::events::Recorder::new(env.client.clone(), "dlq-replay-conformance".into());
    recorder
        .publish(
            &kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Normal,
                reason: "Started".into(),
                note: Some("replay started".into()),
                action: "Replay".into(),
                secondary: None,
            },
            &reference,
        )
        .await
        .expect("publish events.k8s.io/v1 event");
    let core: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
        "metadata": {"name": "ev.core"},
        "involvedObject": serde_json::to_value(&reference).unwrap(),
        "reason": "Legacy",
        "message": "core v1 event",
        "type": "Normal",
        "source": {"component": "dlq-replay-conformance"},
    }))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::Event>::namespaced(env.client.clone(), &env.ns)
        .create(&PostParams::default(), &core)
        .await
        .expect("create core v1 event");
    let new_events =
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(env.client.clone(), &env.ns)
            .list(&ListParams::default())
            .await
            .unwrap();
    assert!(
        new_events
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("Started")),
        "events.k8s.io/v1 event listed"
    );
    if let Some(fake) = &env.fake {
        let events = fake.events();
        let reasons: Vec<&str> = events.iter().filter_map(|e| e["reason"].as_str()).collect();
        assert_eq!(reasons, ["Started", "Legacy"], "{events:#?}");
        assert_eq!(events[0]["apiVersion"], "events.k8s.io/v1");
        assert_eq!(events[1]["apiVersion"], "v1");
        assert_eq!(events[0]["regarding"]["name"], "ev");
        assert_eq!(events[1]["involvedObject"]["name"], "ev");
    }
}
