//! Objects as a real API server keeps them: resourceVersion and generation, the spec and the
//! `/status` subresource apart, finalizers holding a deletion, deletion of a custom resource.

use super::*;

pub(crate) async fn resource_version_grows(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("rv-a", &env.ns))
        .await
        .unwrap();
    let rv1 = rv(&a);
    let a2 = api
        .patch(
            "rv-a",
            &pp(),
            &merge(json!({"metadata": {"labels": {"n": "1"}}})),
        )
        .await
        .unwrap();
    let rv2 = rv(&a2);
    assert!(rv2 > rv1, "{rv2} > {rv1}");
    let s: Secret =
        serde_json::from_value(json!({"metadata": {"name": "rv-s"}, "stringData": {"k": "v"}}))
            .unwrap();
    let s = env
        .secrets()
        .create(&PostParams::default(), &s)
        .await
        .unwrap();
    let rv3 = rv(&s);
    assert!(rv3 > rv2, "{rv3} > {rv2}");
    let list = api.list(&ListParams::default()).await.unwrap();
    let list_rv: u64 = list.metadata.resource_version.unwrap().parse().unwrap();
    assert!(list_rv >= rv3, "list {list_rv} >= {rv3}");
    // A read does not bump it; a no-op write neither.
    let got = api.get("rv-a").await.unwrap();
    assert_eq!(rv(&got), rv2);
    let same = api
        .patch(
            "rv-a",
            &pp(),
            &merge(json!({"metadata": {"labels": {"n": "1"}}})),
        )
        .await
        .unwrap();
    assert_eq!(rv(&same), rv2, "a no-op patch keeps the resourceVersion");
    assert!(a.uid().is_some_and(|u| !u.is_empty()), "uid assigned");
    assert!(
        a.meta().creation_timestamp.is_some(),
        "creationTimestamp set"
    );
}

pub(crate) async fn generation_bumps_only_on_spec_changes(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("gen", &env.ns))
        .await
        .unwrap();
    assert_eq!(generation(&a), 1);
    let labelled = api
        .patch(
            "gen",
            &pp(),
            &merge(json!({"metadata": {"labels": {"x": "y"}, "annotations": {"a": "b"}}})),
        )
        .await
        .unwrap();
    assert_eq!(generation(&labelled), 1, "metadata-only change");
    assert!(rv(&labelled) > rv(&a));
    let st = api
        .patch_status(
            "gen",
            &pp(),
            &merge(json!({"status": {"phase": "Draining"}})),
        )
        .await
        .unwrap();
    assert_eq!(generation(&st), 1, "status change");
    let spec = api
        .patch("gen", &pp(), &merge(json!({"spec": {"suspend": true}})))
        .await
        .unwrap();
    assert_eq!(generation(&spec), 2, "spec change");
    assert!(spec.spec.suspend);
    // A replace that keeps the spec keeps the generation.
    let mut again = spec.clone();
    again
        .metadata
        .labels
        .get_or_insert_default()
        .insert("z".into(), "1".into());
    let replaced = api
        .replace("gen", &PostParams::default(), &again)
        .await
        .unwrap();
    assert_eq!(generation(&replaced), 2, "replace without spec change");
    // (`suspend` is the one spec field the CRD lets change.)
    let mut changed = replaced.clone();
    changed.spec.suspend = false;
    let replaced = api
        .replace("gen", &PostParams::default(), &changed)
        .await
        .unwrap();
    assert_eq!(generation(&replaced), 3, "replace with spec change");
    // A spec change the CRD refuses changes nothing, the generation included.
    let mut refused = replaced.clone();
    refused.spec.dry_run = true;
    let e = api
        .replace("gen", &PostParams::default(), &refused)
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(generation(&api.get("gen").await.unwrap()), 3);
}

pub(crate) async fn status_and_spec_are_separate(env: &Env) {
    let api = env.replays();
    let mut with_status = replay("sub", &env.ns);
    with_status.status = Some(DlqReplayStatus::from(ReplayStatus {
        phase: Some(Phase::Done),
        ..Default::default()
    }));
    let created = api
        .create(&PostParams::default(), &with_status)
        .await
        .unwrap();
    assert!(
        created.status.as_ref().and_then(|s| s.phase).is_none(),
        "create ignores .status: {:?}",
        created.status
    );
    // A status patch cannot change spec.
    let st = api
        .patch_status(
            "sub",
            &pp(),
            &merge(
                json!({"spec": {"suspend": true}, "status": {"phase": "Draining", "message": "m"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(st.status.as_ref().unwrap().phase, Some(Phase::Draining));
    assert!(!st.spec.suspend, "status patch changed spec");
    // A spec patch cannot change status.
    let sp = api
        .patch(
            "sub",
            &pp(),
            &merge(json!({"spec": {"suspend": true}, "status": {"phase": "Failed"}})),
        )
        .await
        .unwrap();
    assert!(sp.spec.suspend);
    assert_eq!(
        sp.status.as_ref().unwrap().phase,
        Some(Phase::Draining),
        "spec patch changed status"
    );
    // Same for replace and replace_status.
    let mut body = sp.clone();
    body.spec.suspend = false;
    body.status.as_mut().unwrap().phase = Some(Phase::Done);
    let rs = api
        .replace_status("sub", &PostParams::default(), &body)
        .await
        .unwrap();
    assert_eq!(rs.status.as_ref().unwrap().phase, Some(Phase::Done));
    assert!(rs.spec.suspend, "replace_status changed spec");
    let mut body = rs.clone();
    body.spec.suspend = false;
    body.status.as_mut().unwrap().phase = Some(Phase::Failed);
    let r = api
        .replace("sub", &PostParams::default(), &body)
        .await
        .unwrap();
    assert!(!r.spec.suspend);
    assert_eq!(
        r.status.as_ref().unwrap().phase,
        Some(Phase::Done),
        "replace changed status"
    );
    let got = api.get_status("sub").await.unwrap();
    assert_eq!(got.status.unwrap().phase, Some(Phase::Done));
}

pub(crate) async fn finalizers_hold_deletion(env: &Env) {
    let api = env.replays();
    let mut r = replay("fin", &env.ns);
    r.metadata.finalizers = Some(vec![FINALIZER.into()]);
    api.create(&PostParams::default(), &r).await.unwrap();
    let deleted = api.delete("fin", &DeleteParams::default()).await.unwrap();
    let held = deleted
        .left()
        .expect("object kept while a finalizer is on it");
    assert!(held.meta().deletion_timestamp.is_some());
    let got = api.get("fin").await.unwrap();
    assert!(
        got.meta().deletion_timestamp.is_some(),
        "deletionTimestamp set"
    );
    assert_eq!(got.finalizers(), [FINALIZER.to_string()]);
    // A failed JSON-patch test is refused, and nothing changes.
    let wrong: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": "someone-else"},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]))
    .unwrap();
    let e = api
        .patch("fin", &pp(), &Patch::Json::<()>(wrong))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(api.get("fin").await.unwrap().finalizers().len(), 1);
    // Removing the last finalizer lets the deletion finish.
    let remove: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers/0", "value": FINALIZER},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]))
    .unwrap();
    api.patch("fin", &pp(), &Patch::Json::<()>(remove))
        .await
        .unwrap();
    let gone = eventually(Duration::from_secs(20), || async {
        api.get_opt("fin").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(
        gone.is_some(),
        "object still there after its last finalizer went"
    );

    // kube's finalizer helper: adds its finalizer (JSON patch testing a missing path for null),
    // then on deletion runs cleanup and removes it.
    api.create(&PostParams::default(), &replay("helper", &env.ns))
        .await
        .unwrap();
    let obj = Arc::new(api.get("helper").await.unwrap());
    finalizer(&api, FINALIZER, obj, |_| async {
        Ok::<_, std::io::Error>(kube::runtime::controller::Action::await_change())
    })
    .await
    .expect("finalizer added");
    let obj = api.get("helper").await.unwrap();
    assert_eq!(obj.finalizers(), [FINALIZER.to_string()]);
    api.delete("helper", &DeleteParams::default())
        .await
        .unwrap();
    let obj = Arc::new(api.get("helper").await.unwrap());
    assert!(obj.meta().deletion_timestamp.is_some());
    let mut cleaned = false;
    finalizer(&api, FINALIZER, obj, |ev| {
        cleaned = matches!(ev, finalizer::Event::Cleanup(_));
        async { Ok::<_, std::io::Error>(kube::runtime::controller::Action::await_change()) }
    })
    .await
    .expect("finalizer removed");
    assert!(cleaned, "cleanup ran");
    let gone = eventually(Duration::from_secs(20), || async {
        api.get_opt("helper").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(gone.is_some(), "helper's object still there after cleanup");
}

/// Deleting a replay without finalizers answers a `Status` and a watch sees it DELETED; strategic
/// merge patches are refused for custom resources (415).
pub(crate) async fn delete_of_custom_resource_answers_status_and_watch_sees_deleted(env: &Env) {
    let api = env.replays();
    let a = api
        .create(&PostParams::default(), &replay("d", &env.ns))
        .await
        .unwrap();
    let mut s = api
        .watch(
            &WatchParams::default().timeout(30),
            &a.resource_version().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    let res = api.delete("d", &DeleteParams::default()).await.unwrap();
    assert!(
        res.is_right(),
        "a Status for an immediate delete of a custom resource"
    );
    // Generous: under a loaded CI machine the event can take seconds; a missing one still fails.
    let deleted = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match s.try_next().await {
                Ok(Some(WatchEvent::Bookmark(_))) => {}
                other => return other,
            }
        }
    })
    .await;
    match deleted {
        Ok(Ok(Some(WatchEvent::Deleted(o)))) => assert!(rv(&o) > rv(&a)),
        other => panic!("expected DELETED, got {other:?}"),
    }
    assert!(api.get_opt("d").await.unwrap().is_none());
    api.create(&PostParams::default(), &replay("d", &env.ns))
        .await
        .unwrap();
    let e = api
        .patch(
            "d",
            &pp(),
            &Patch::Strategic(json!({"spec": {"suspend": true}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 415, "{e:?}");
}
