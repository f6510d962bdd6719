//! Writes: patches of every kind, errors as `Status` objects, server-side apply and its conflicts.

use super::*;

pub(crate) async fn patches_of_every_kind(env: &Env) {
    let api = env.replays();
    api.create(&PostParams::default(), &replay("p", &env.ns))
        .await
        .unwrap();
    // Merge patch (RFC 7386): set, then null removes.
    let m = api
        .patch(
            "p",
            &pp(),
            &merge(json!({"metadata": {"labels": {"a": "1", "b": "2"}}})),
        )
        .await
        .unwrap();
    assert_eq!(m.labels().get("a").map(String::as_str), Some("1"));
    let m = api
        .patch(
            "p",
            &pp(),
            &merge(json!({"metadata": {"labels": {"a": null}}})),
        )
        .await
        .unwrap();
    assert!(!m.labels().contains_key("a"));
    assert_eq!(m.labels().get("b").map(String::as_str), Some("2"));
    // JSON patch (RFC 6902) with a passing test op.
    let jp: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/source/queue", "value": "p-dlq"},
        {"op": "replace", "path": "/spec/suspend", "value": true},
        {"op": "add", "path": "/metadata/annotations", "value": {"k": "v"}},
    ]))
    .unwrap();
    let j = api.patch("p", &pp(), &Patch::Json::<()>(jp)).await.unwrap();
    assert!(j.spec.suspend);
    assert_eq!(j.annotations().get("k").map(String::as_str), Some("v"));
    // A JSON patch the CRD refuses (the source queue is immutable) changes nothing.
    let jp: json_patch::Patch = serde_json::from_value(json!([
        {"op": "replace", "path": "/spec/source/queue", "value": "p-dlq-2"},
        {"op": "add", "path": "/metadata/annotations/k2", "value": "v2"},
    ]))
    .unwrap();
    let e = api
        .patch("p", &pp(), &Patch::Json::<()>(jp))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["spec.source"], "{e:?}");
    let unchanged = api.get("p").await.unwrap();
    assert_eq!(unchanged.spec.source.queue, "p-dlq");
    assert!(!unchanged.annotations().contains_key("k2"));
    // Merge patch with a stale resourceVersion conflicts.
    let e = api
        .patch(
            "p",
            &pp(),
            &merge(json!({"metadata": {"resourceVersion": "1", "labels": {"c": "3"}}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 409, "{e:?}");
    // Server-side apply: the given fields change, the rest stay.
    let ap = api
        .patch(
            "p",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "metadata": {"name": "p", "labels": {"applied": "yes"}},
                "spec": {"suspend": false},
            })),
        )
        .await
        .unwrap();
    assert_eq!(ap.labels().get("applied").map(String::as_str), Some("yes"));
    assert!(!ap.spec.suspend);
    assert_eq!(ap.spec.source.queue, "p-dlq");
    // Apply creates an absent object.
    let fresh = serde_json::to_value(replay("p-new", &env.ns)).unwrap();
    let created = api
        .patch(
            "p-new",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(fresh),
        )
        .await
        .unwrap();
    assert_eq!(created.spec.source.queue, "p-new-dlq");
    assert_eq!(generation(&created), 1);
    // Apply to /status.
    let st = api
        .patch_status(
            "p",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "metadata": {"name": "p"},
                "status": {"phase": "Pending"},
            })),
        )
        .await
        .unwrap();
    assert_eq!(st.status.unwrap().phase, Some(Phase::Pending));
    // Strategic merge on a built-in resource (Secret).
    let s: Secret =
        serde_json::from_value(json!({"metadata": {"name": "p-s"}, "stringData": {"a": "1"}}))
            .unwrap();
    env.secrets()
        .create(&PostParams::default(), &s)
        .await
        .unwrap();
    let s = env
        .secrets()
        .patch(
            "p-s",
            &pp(),
            &Patch::Strategic(json!({"stringData": {"b": "2"}})),
        )
        .await
        .unwrap();
    let data = s.data.unwrap();
    assert_eq!(data["a"].0, b"1");
    assert_eq!(data["b"].0, b"2");
}

pub(crate) async fn errors_are_statuses(env: &Env) {
    let api = env.replays();
    let e = api.get("missing").await.unwrap_err();
    assert_eq!(api_code(&e), (404, "NotFound".into()));
    assert!(api.get_opt("missing").await.unwrap().is_none());
    let e = api
        .patch("missing", &pp(), &merge(json!({"spec": {"suspend": true}})))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 404);
    let e = api
        .delete("missing", &DeleteParams::default())
        .await
        .unwrap_err();
    assert_eq!(api_code(&e).0, 404);
    let created = api
        .create(&PostParams::default(), &replay("dup", &env.ns))
        .await
        .unwrap();
    let e = api
        .create(&PostParams::default(), &replay("dup", &env.ns))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (409, "AlreadyExists".into()));
    // Optimistic concurrency on replace.
    let mut first = created.clone();
    first.spec.suspend = true;
    let updated = api
        .replace("dup", &PostParams::default(), &first)
        .await
        .unwrap();
    let mut stale = created.clone();
    stale.spec.suspend = false;
    stale
        .metadata
        .labels
        .get_or_insert_default()
        .insert("late".into(), "1".into());
    let e = api
        .replace("dup", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (409, "Conflict".into()));
    let mut current = updated.clone();
    current
        .metadata
        .labels
        .get_or_insert_default()
        .insert("late".into(), "1".into());
    let ok = api
        .replace("dup", &PostParams::default(), &current)
        .await
        .unwrap();
    assert!(ok.spec.suspend && ok.labels().contains_key("late"));
    // A delete without finalizers removes the object.
    api.delete("dup", &DeleteParams::default()).await.unwrap();
    let gone = eventually(Duration::from_secs(20), || async {
        api.get_opt("dup").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(gone.is_some());
}

pub(crate) async fn server_side_apply_conflicts(env: &Env) {
    let leases = env.leases();
    let lease: Lease =
        serde_json::from_value(json!({"metadata": {"name": "ssa"}, "spec": {}})).unwrap();
    leases.create(&PostParams::default(), &lease).await.unwrap();
    let holder = |who: &str| {
        Patch::Apply(json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "ssa"},
            "spec": {"holderIdentity": who, "leaseDurationSeconds": 15},
        }))
    };
    let a = leases
        .patch("ssa", &PatchParams::apply("manager-a"), &holder("a"))
        .await
        .unwrap();
    assert_eq!(a.spec.unwrap().holder_identity.as_deref(), Some("a"));
    // Another manager setting a field owned by manager-a to another value conflicts.
    let e = leases
        .patch("ssa", &PatchParams::apply("manager-b"), &holder("b"))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (409, "Conflict".into()), "{e:?}");
    // One `FieldManagerConflict` cause per field, naming the owner.
    assert_eq!(causes(&e), [".spec.holderIdentity"], "{e:?}");
    let kube::Error::Api(s) = &e else {
        unreachable!()
    };
    let cause = &s.details.as_ref().unwrap().causes[0];
    assert_eq!(
        (cause.reason.as_str(), cause.message.as_str()),
        ("FieldManagerConflict", r#"conflict with "manager-a""#),
        "{e:?}"
    );
    let now = leases.get("ssa").await.unwrap();
    assert_eq!(now.spec.unwrap().holder_identity.as_deref(), Some("a"));
    // The same manager may change its own fields; forcing takes the fields over.
    leases
        .patch("ssa", &PatchParams::apply("manager-a"), &holder("a2"))
        .await
        .unwrap();
    let b = leases
        .patch(
            "ssa",
            &PatchParams::apply("manager-b").force(),
            &holder("b"),
        )
        .await
        .unwrap();
    assert_eq!(b.spec.unwrap().holder_identity.as_deref(), Some("b"));
    let e = leases
        .patch("ssa", &PatchParams::apply("manager-a"), &holder("a3"))
        .await
        .unwrap_err();
    assert_eq!(
        api_code(&e).0,
        409,
        "manager-a lost the field to the forced apply"
    );
    // Merge patches never conflict.
    let m = leases
        .patch(
            "ssa",
            &PatchParams::default(),
            &merge(json!({"spec": {"holderIdentity": null}})),
        )
        .await
        .unwrap();
    assert!(m.spec.unwrap().holder_identity.is_none());
    // Once the field is gone, anyone may apply it.
    leases
        .patch("ssa", &PatchParams::apply("manager-a"), &holder("a4"))
        .await
        .unwrap();
}
