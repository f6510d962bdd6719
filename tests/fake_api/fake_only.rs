//! The fake's own helpers (`put_secret`, `events`, `status_writes`, `get_json`, `expire_watches`)
//! and what a shared cluster cannot be made to show quickly: another CRD installed (ratcheting), a
//! watch expired on demand, streaming lists (which the tests' etcd 3.5.1 cannot serve).

use super::*;

/// A replay an older CRD admitted (`messagesPerSecond: 0`, quarantine = source) after the
/// committed CRD is applied over it: what leaves the bad values alone passes (ratcheting:
/// metadata, the status, the finalizer the operator adds), a change of the spec is checked
/// again, and the cross-field rule of the changed spec node refuses it.
#[tokio::test]
async fn an_upgraded_crd_ratchets_what_an_older_one_admitted() {
    use dlq_replay_testkit::fake_api::{committed_crd, crd_before_the_rules};
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let fake = FakeApi::start().await;
    let crds: Api<CustomResourceDefinition> = Api::all(fake.client());
    let name = committed_crd().metadata.name.unwrap();
    let apply = |crd: CustomResourceDefinition| {
        let crds = crds.clone();
        let name = name.clone();
        async move {
            crds.patch(
                &name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(crd),
            )
            .await
            .expect("apply the CRD")
        }
    };
    apply(crd_before_the_rules()).await;
    let env = Env {
        client: fake.client(),
        ns: "ops".into(),
        fake: None,
    };
    let bad = json!({"rate": {"messagesPerSecond": 0}, "quarantine": {"queue": "old-dlq"}});
    raw_replays(&env)
        .create(&PostParams::default(), &raw_replay("old", bad.clone()))
        .await
        .expect("admitted by the older CRD");
    apply(committed_crd()).await;
    // Now refused on create...
    let e = raw_replays(&env)
        .create(&PostParams::default(), &raw_replay("new", bad))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 422);
    // ...but the stored one may still be labelled, finalized and given a status.
    let api = env.replays();
    api.patch(
        "old",
        &pp(),
        &merge(json!({"metadata": {"labels": {"a": "b"}}})),
    )
    .await
    .expect("a metadata change");
    api.patch(
        "old",
        &pp(),
        &merge(json!({"metadata": {"finalizers": [FINALIZER]}})),
    )
    .await
    .expect("a finalizer");
    api.patch_status("old", &pp(), &merge(json!({"status": {"phase": "Failed"}})))
        .await
        .expect("a status write");
    // A change of the spec evaluates the spec's rules again: the unchanged rate is
    // ratcheted, the cross-field rule of the changed node is not.
    let e = api
        .patch("old", &pp(), &merge(json!({"spec": {"suspend": true}})))
        .await
        .unwrap_err();
    assert_eq!(causes(&e), ["spec.quarantine.queue"], "{e:?}");
}

#[tokio::test]
async fn put_secret_is_visible_to_get_and_watch() {
    let fake = FakeApi::start().await;
    let secrets: Api<Secret> = Api::namespaced(fake.client(), "ops");
    let list = secrets.list(&ListParams::default()).await.unwrap();
    let from = list.metadata.resource_version.unwrap();
    let mut stream = secrets
        .watch(&WatchParams::default().timeout(10), &from)
        .await
        .unwrap()
        .boxed();
    fake.put_secret("ops", "amqp", &[("url", "amqp://x"), ("user", "guest")]);
    let s = secrets.get("amqp").await.unwrap();
    let data = s.data.unwrap();
    assert_eq!(data["url"].0, b"amqp://x");
    assert_eq!(data["user"].0, b"guest");
    let raw = fake.get_json("secrets", "ops", "amqp").unwrap();
    assert_eq!(raw["data"]["url"], "YW1xcDovL3g=");
    match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
        Ok(Ok(Some(WatchEvent::Added(s)))) => assert_eq!(s.name_any(), "amqp"),
        other => panic!("expected ADDED amqp, got {other:?}"),
    }
    // A second put replaces the data and is a MODIFIED.
    fake.put_secret("ops", "amqp", &[("url", "amqp://y")]);
    match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
        Ok(Ok(Some(WatchEvent::Modified(s)))) => {
            let data = s.data.unwrap();
            assert_eq!(data["url"].0, b"amqp://y");
            assert!(!data.contains_key("user"));
        }
        other => panic!("expected MODIFIED amqp, got {other:?}"),
    }
    // Default namespace of the client is "default".
    fake.put_secret("default", "d", &[("k", "v")]);
    let d: Api<Secret> = Api::default_namespaced(fake.client());
    assert!(d.get_opt("d").await.unwrap().is_some());
}

#[tokio::test]
async fn status_writes_are_counted() {
    let fake = FakeApi::start().await;
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), "ops");
    api.create(&PostParams::default(), &replay("sw", "ops"))
        .await
        .unwrap();
    assert_eq!(fake.status_writes("ops", "sw"), 0);
    let st = json!({"status": {"phase": "Pending"}});
    api.patch_status("sw", &pp(), &merge(st.clone()))
        .await
        .unwrap();
    api.patch_status("sw", &pp(), &merge(st)).await.unwrap();
    api.patch("sw", &pp(), &merge(json!({"spec": {"suspend": true}})))
        .await
        .unwrap();
    assert_eq!(
        fake.status_writes("ops", "sw"),
        2,
        "spec writes are not status writes"
    );
    let raw = fake.get_json("dlqreplays", "ops", "sw").unwrap();
    assert_eq!(raw["status"]["phase"], "Pending");
    assert_eq!(raw["metadata"]["generation"], 2);
    assert!(fake.get_json("dlqreplays", "ops", "nope").is_none());
}

/// Streaming lists (`sendInitialEvents`): not on the real server of the tests, whose etcd
/// (3.5.1) lacks what kube-apiserver needs for them (it answers 500, "the required storage
/// feature RequestWatchProgress is disabled"); the operator lists, then watches.
#[tokio::test]
async fn streaming_list_watcher_works() {
    let fake = FakeApi::start().await;
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), "ops");
    api.create(&PostParams::default(), &replay("s1", "ops"))
        .await
        .unwrap();
    let mut w = watcher(api.clone(), watcher::Config::default().streaming_lists()).boxed();
    let mut initial = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(ev) = w.next().await {
            match ev.unwrap() {
                watcher::Event::InitApply(o) => initial.push(o.name_any()),
                watcher::Event::InitDone => break,
                _ => {}
            }
        }
    })
    .await
    .expect("initial events");
    assert_eq!(initial, ["s1"]);
    api.create(&PostParams::default(), &replay("s2", "ops"))
        .await
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), w.next()).await;
    assert!(
        matches!(&next, Ok(Some(Ok(watcher::Event::Apply(o)))) if o.name_any() == "s2"),
        "{next:?}"
    );
}

#[tokio::test]
async fn expired_watch_answers_410_error_event() {
    let fake = FakeApi::start().await;
    let api: Api<DlqReplay> = Api::namespaced(fake.client(), "ops");
    let a = api
        .create(&PostParams::default(), &replay("x", "ops"))
        .await
        .unwrap();
    fake.expire_watches();
    let mut s = api
        .watch(&WatchParams::default(), &a.resource_version().unwrap())
        .await
        .unwrap()
        .boxed();
    match s.try_next().await {
        Ok(Some(WatchEvent::Error(st))) => {
            assert_eq!(st.code, 410);
            assert_eq!(st.reason, "Expired");
        }
        other => panic!("expected an ERROR 410 event, got {other:?}"),
    }
    assert!(
        s.try_next().await.unwrap().is_none(),
        "the stream ends after the 410"
    );
    // From the current version it is fine.
    let now = api.list(&ListParams::default()).await.unwrap();
    let mut s = api
        .watch(
            &WatchParams::default().timeout(5),
            &now.metadata.resource_version.unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    api.patch(
        "x",
        &pp(),
        &merge(json!({"metadata": {"labels": {"a": "b"}}})),
    )
    .await
    .unwrap();
    assert!(matches!(
        s.try_next().await,
        Ok(Some(WatchEvent::Modified(_)))
    ));
}
