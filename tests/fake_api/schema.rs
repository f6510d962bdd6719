//! The CRD's rules, on the fake and a real server alike: bad and changed specs refused naming the
//! field, unknown fields pruned (warned about) or refused, defaults applied, the status validated.

use super::*;

/// The replays as raw JSON: what the CLI (and so the typed `replay`) refuses can still be sent.
pub(crate) fn raw_replays(env: &Env) -> Api<DynamicObject> {
    Api::namespaced_with(
        env.client.clone(),
        &env.ns,
        &ApiResource::erase::<DlqReplay>(&()),
    )
}

/// A minimal valid replay as JSON, with `spec` merged into its spec (RFC 7386).
pub(crate) fn raw_replay(name: &str, spec: Value) -> DynamicObject {
    let mut obj = json!({
        "apiVersion": "replay.dlq.dev/v1alpha1",
        "kind": "DlqReplay",
        "metadata": {"name": name},
        "spec": {
            "broker": {"url": "amqp://guest:guest@127.0.0.1:5672/%2f"},
            "source": {"queue": format!("{name}-dlq")},
            "quarantine": {"queue": format!("{name}-quarantine")},
        },
    });
    json_patch::merge(&mut obj["spec"], &spec);
    serde_json::from_value(obj).expect("a DynamicObject")
}

/// The specs a real API server admitted before the CRD carried the rules, each refused now with
/// 422 naming its field, and not stored. The message never repeats the URL's password.
pub(crate) async fn bad_specs_are_refused_naming_the_field(env: &Env) {
    let api = raw_replays(env);
    let redis = json!({"url": "redis://127.0.0.1:6379/0"});
    let cases = [
        (
            "rate-zero",
            json!({"rate": {"messagesPerSecond": 0}}),
            "spec.rate.messagesPerSecond",
        ),
        (
            "same-queue",
            json!({"quarantine": {"queue": "same-queue-dlq"}}),
            "spec.quarantine.queue",
        ),
        (
            "no-slash",
            json!({"idempotency": {"redis": redis, "key": {"fields": [{"pointer": "asset_id"}]}}}),
            "spec.idempotency.key.fields[0].pointer",
        ),
        (
            "wait-zero",
            json!({"canary": {"waitSeconds": 0}}),
            "spec.canary.waitSeconds",
        ),
        (
            "both-urls",
            json!({"broker": {"url": "amqp://guest:s3cr3t-pw@127.0.0.1:5672/%2f", "urlSecretRef": {"name": "rabbitmq", "key": "url"}}}),
            "spec.broker",
        ),
        (
            "no-broker-url",
            json!({"broker": {"url": null}}),
            "spec.broker",
        ),
        (
            "http-url",
            json!({"broker": {"url": "http://guest:s3cr3t-pw@127.0.0.1:5672/"}}),
            "spec.broker.url",
        ),
        (
            "cluster-url-bad-port",
            json!({"broker": {"url": "amqp://guest:s3cr3t-pw@127.0.0.1:5681,127.0.0.1:99999/%2f"}}),
            "spec.broker.url",
        ),
        (
            "sentinel-url-for-broker",
            json!({"broker": {"url": "redis+sentinel://127.0.0.1:26390/m"}}),
            "spec.broker.url",
        ),
        (
            "burst-zero",
            json!({"rate": {"messagesPerSecond": 10, "burst": 0}}),
            "spec.rate.burst",
        ),
        (
            "payload-without-condition",
            json!({"selector": {"payload": [{"pointer": "/show"}]}}),
            "spec.selector.payload[0]",
        ),
        (
            "require-done-in-claim-mode",
            json!({"idempotency": {"redis": redis, "mode": "Claim", "key": {"fields": [{"pointer": "/id"}]}}, "canary": {"requireDone": true}}),
            "spec.canary.requireDone",
        ),
        ("expect-everything", json!({"expect": {}}), "spec.expect"),
        (
            "expect-max-replayed-0",
            json!({"expect": {"maxReplayed": 0}}),
            "spec.expect.maxReplayed",
        ),
        (
            "expect-empty-signature",
            json!({"expect": {"signatures": [""]}}),
            "spec.expect.signatures[0]",
        ),
    ];
    for (name, spec, field) in cases {
        let e = api
            .create(&PostParams::default(), &raw_replay(name, spec))
            .await
            .expect_err(name);
        assert_eq!(api_code(&e), (422, "Invalid".into()), "{name}: {e:?}");
        assert!(causes(&e).iter().any(|c| c == field), "{name}: {e:?}");
        let kube::Error::Api(status) = &e else {
            unreachable!()
        };
        assert!(
            status.message.contains(field) && !status.message.contains("s3cr3t-pw"),
            "{name}: {}",
            status.message
        );
        assert!(api.get_opt(name).await.unwrap().is_none(), "{name} stored");
    }
}

/// Every spec field but `suspend` is fixed once the replay exists: a change of one, by any kind
/// of write, is refused with 422 naming it (`FieldValueForbidden`), and nothing changes.
pub(crate) async fn immutable_fields_are_refused_naming_the_field(env: &Env) {
    let api = env.replays();
    let created = api
        .create(&PostParams::default(), &replay("imm", &env.ns))
        .await
        .unwrap();
    let forbidden = |e: &kube::Error, field: &str| {
        assert_eq!(api_code(e), (422, "Invalid".into()), "{e:?}");
        let kube::Error::Api(s) = e else {
            unreachable!()
        };
        let cause = s
            .details
            .iter()
            .flat_map(|d| d.causes.iter())
            .find(|c| c.field == field)
            .unwrap_or_else(|| panic!("no cause for {field}: {e:?}"));
        assert_eq!(cause.reason, "FieldValueForbidden", "{e:?}");
    };
    let changes = [
        (
            json!({"spec": {"source": {"queue": "other"}}}),
            "spec.source",
        ),
        (json!({"spec": {"dryRun": true}}), "spec.dryRun"),
        (
            json!({"spec": {"rate": {"messagesPerSecond": 10}}}),
            "spec.rate",
        ),
        (
            json!({"spec": {"canary": {"waitSeconds": 60}}}),
            "spec.canary",
        ),
    ];
    for (patch, field) in changes {
        let e = api.patch("imm", &pp(), &merge(patch)).await.unwrap_err();
        forbidden(&e, field);
    }
    let mut replaced = created.clone();
    replaced.spec.quarantine.queue = "other-quarantine".into();
    let e = api
        .replace("imm", &PostParams::default(), &replaced)
        .await
        .unwrap_err();
    forbidden(&e, "spec.quarantine");
    let e = api
        .patch(
            "imm",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "metadata": {"name": "imm"},
                "spec": {"broker": {"url": "amqp://guest:guest@127.0.0.1:5673/%2f"}},
            })),
        )
        .await
        .unwrap_err();
    forbidden(&e, "spec.broker");
    let now = api.get("imm").await.unwrap();
    assert_eq!(now.spec, created.spec, "a refused write changed the spec");
    assert_eq!(generation(&now), 1);
    // `suspend` may change.
    let suspended = api
        .patch("imm", &pp(), &merge(json!({"spec": {"suspend": true}})))
        .await
        .unwrap();
    assert!(suspended.spec.suspend);
    assert_eq!(generation(&suspended), 2);
}

/// Fields the schema does not know are pruned (the default `fieldValidation=Warn`), refused under
/// `fieldValidation=Strict` (a create with 400 `BadRequest`; a merge patch with 422 `Invalid`, one
/// cause, field `patch`: kube-apiserver decodes the patched object strictly), and fail a
/// server-side apply.
pub(crate) async fn unknown_fields_are_pruned_or_refused(env: &Env) {
    let api = raw_replays(env);
    let created = api
        .create(
            &PostParams::default(),
            &raw_replay("unk", json!({"bogus": 1, "source": {"extra": "x"}})),
        )
        .await
        .unwrap();
    let spec = &created.data["spec"];
    assert!(spec.get("bogus").is_none(), "{spec}");
    assert_eq!(spec["source"], json!({"queue": "unk-dlq"}));
    let stored = api.get("unk").await.unwrap();
    assert!(stored.data["spec"].get("bogus").is_none());
    // A merge patch: pruned, so no spec change (the generation stays).
    let patched = api
        .patch("unk", &pp(), &merge(json!({"spec": {"bogus": 2}})))
        .await
        .unwrap();
    assert!(patched.data["spec"].get("bogus").is_none());
    assert_eq!(patched.metadata.generation, Some(1));
    // Strict: a create is refused with 400, naming every unknown field...
    let body = serde_json::to_vec(&raw_replay(
        "unk-strict",
        json!({"bogus": 1, "source": {"extra": "x"}}),
    ))
    .unwrap();
    let request = hyper::Request::post(format!(
        "/apis/replay.dlq.dev/v1alpha1/namespaces/{}/dlqreplays?fieldValidation=Strict",
        env.ns
    ))
    .header("content-type", "application/json")
    .body(body)
    .unwrap();
    let e = env
        .client
        .request::<DynamicObject>(request)
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (400, "BadRequest".into()), "{e:?}");
    let kube::Error::Api(s) = &e else {
        unreachable!()
    };
    assert!(
        s.message.ends_with(
            r#"strict decoding error: unknown field "spec.bogus", unknown field "spec.source.extra""#
        ),
        "{}",
        s.message
    );
    assert!(api.get_opt("unk-strict").await.unwrap().is_none());
    // ...and a merge patch with 422 `Invalid`, one cause (field `patch`) naming the field.
    let e = api
        .patch(
            "unk",
            &PatchParams::default().validation_strict(),
            &merge(json!({"spec": {"bogus": 3}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["patch"], "{e:?}");
    let kube::Error::Api(s) = &e else {
        unreachable!()
    };
    let cause = &s.details.as_ref().unwrap().causes[0];
    assert_eq!(cause.reason, "FieldValueInvalid", "{e:?}");
    assert!(
        cause
            .message
            .ends_with(r#"strict decoding error: unknown field "spec.bogus""#),
        "{}",
        cause.message
    );
    assert!(
        s.message
            .starts_with(r#" "" is invalid: patch: Invalid value: "#),
        "{}",
        s.message
    );
    // The same on /status, for an unknown field of the status.
    let e = api
        .patch_status(
            "unk",
            &PatchParams::default().validation_strict(),
            &merge(json!({"status": {"bogus": 1}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["patch"], "{e:?}");
    let stored = api.get("unk").await.unwrap();
    assert_eq!(stored.metadata.generation, Some(1));
    assert!(stored.data["spec"].get("bogus").is_none());
    // Server-side apply types the patch with the schema: an undeclared field fails it
    // (kube-apiserver v1.36 answers 500).
    let e = api
        .patch(
            "unk",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "metadata": {"name": "unk"},
                "spec": {"bogus": 4},
            })),
        )
        .await
        .unwrap_err();
    let kube::Error::Api(s) = &e else {
        panic!("{e:?}")
    };
    assert!(s.code == 500 || s.code == 400, "{e:?}");
    assert!(
        s.message
            .contains(".spec.bogus: field not declared in schema"),
        "{}",
        s.message
    );
}

/// The API server fills in the schema's defaults: the spec's on create, the status's on a
/// status write.
pub(crate) async fn defaults_are_applied(env: &Env) {
    let api = raw_replays(env);
    let created = api
        .create(&PostParams::default(), &raw_replay("dft", json!({})))
        .await
        .unwrap();
    let spec = &created.data["spec"];
    assert_eq!(spec["canary"]["waitSeconds"], 120, "{spec}");
    assert_eq!(spec["canary"]["enabled"], true, "{spec}");
    assert_eq!(spec["dryRun"], false, "{spec}");
    assert_eq!(spec["suspend"], false, "{spec}");
    assert_eq!(spec["selector"], json!({}), "{spec}");
    let st = api
        .patch_status(
            "dft",
            &pp(),
            &merge(json!({"status": {"phase": "Pending"}})),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"]["counts"]["scanned"], 0, "{}", st.data);
}

/// Writes to `/status` are checked against the status schema. A schema error of the kinds that
/// keep kube-apiserver from evaluating the CEL rules (a value outside the enum, a missing required
/// field, a wrong type, too long, too many) adds a cause with field `<nil>` saying so; one that
/// does not (a bound) does not.
pub(crate) async fn status_is_validated_against_its_schema(env: &Env) {
    const NOT_CHECKED: &str = "Invalid value: null: some validation rules were not checked because the object was invalid; correct the existing errors to complete validation";
    let not_checked = |e: &kube::Error| {
        let kube::Error::Api(s) = e else {
            panic!("{e:?}")
        };
        let cause = s
            .details
            .iter()
            .flat_map(|d| d.causes.iter())
            .find(|c| c.field == "<nil>")
            .unwrap_or_else(|| panic!("no <nil> cause: {e:?}"));
        assert_eq!(
            (cause.reason.as_str(), cause.message.as_str()),
            ("FieldValueInvalid", NOT_CHECKED),
            "{e:?}"
        );
        assert!(
            s.message.ends_with(&format!("<nil>: {NOT_CHECKED}]")),
            "{}",
            s.message
        );
    };
    let api = env.replays();
    api.create(&PostParams::default(), &replay("sts", &env.ns))
        .await
        .unwrap();
    let e = api
        .patch_status("sts", &pp(), &merge(json!({"status": {"phase": "Bogus"}})))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["status.phase", "<nil>"], "{e:?}");
    let kube::Error::Api(s) = &e else {
        unreachable!()
    };
    assert_eq!(
        s.details.as_ref().unwrap().causes[0].reason,
        "FieldValueNotSupported",
        "{e:?}"
    );
    not_checked(&e);
    // A partial `counts` replaces the default: the counts it lacks are missing (blocking).
    let e = api
        .patch_status(
            "sts",
            &pp(),
            &merge(json!({"status": {"counts": {"scanned": -1}}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    let mut got = causes(&e);
    got.sort();
    assert_eq!(
        got,
        [
            "<nil>",
            "status.counts.duplicates",
            "status.counts.failed",
            "status.counts.quarantined",
            "status.counts.replayed",
            "status.counts.scanned",
            "status.counts.skipped",
        ],
        "{e:?}"
    );
    not_checked(&e);
    // Only a bound broken: the rules were checked, no `<nil>` cause.
    let counts = json!({"scanned": -1, "replayed": 0, "duplicates": 0, "quarantined": 0,
        "failed": 0, "skipped": 0});
    let e = api
        .patch_status("sts", &pp(), &merge(json!({"status": {"counts": counts}})))
        .await
        .unwrap_err();
    assert_eq!(api_code(&e), (422, "Invalid".into()), "{e:?}");
    assert_eq!(causes(&e), ["status.counts.scanned"], "{e:?}");
    assert!(
        api.get_status("sts").await.unwrap().status.is_none(),
        "a refused status write was stored"
    );
    // Unknown status fields are pruned; known ones kept.
    let st = api
        .patch_status(
            "sts",
            &pp(),
            &merge(json!({"status": {"phase": "Pending", "bogus": 1}})),
        )
        .await
        .unwrap();
    assert_eq!(st.status.unwrap().phase, Some(Phase::Pending));
    let raw = raw_replays(env).get("sts").await.unwrap();
    assert!(raw.data["status"].get("bogus").is_none(), "{}", raw.data);
    // The operator's own status write: a server-side apply of conditions as Kubernetes' own
    // (`metav1.Condition`, with `observedGeneration`).
    let condition = k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        type_: "Ready".into(),
        status: "False".into(),
        reason: "Pending".into(),
        message: "waiting".into(),
        last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap(),
        ),
        observed_generation: Some(1),
    };
    let applied = api
        .patch_status(
            "sts",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "replay.dlq.dev/v1alpha1",
                "kind": "DlqReplay",
                "status": {"phase": "Pending", "conditions": [condition]},
            })),
        )
        .await
        .unwrap();
    assert_eq!(applied.status.unwrap().conditions[0].reason, "Pending");
}

/// Unknown fields are pruned with a `Warning` header, as kube-apiserver's default
/// `fieldValidation=Warn` does.
pub(crate) async fn pruned_fields_are_warned_about(env: &Env) {
    let body = serde_json::to_vec(&raw_replay("w", json!({"bogus": 1}))).unwrap();
    let request = hyper::Request::post(format!(
        "/apis/replay.dlq.dev/v1alpha1/namespaces/{}/dlqreplays",
        env.ns
    ))
    .header("content-type", "application/json")
    .body(kube::client::Body::from(body))
    .unwrap();
    let response = env.client.send(request).await.unwrap();
    assert_eq!(response.status().as_u16(), 201);
    let warnings: Vec<&str> = response
        .headers()
        .get_all("warning")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(warnings, [r#"299 - "unknown field \"spec.bogus\"""#]);
}
