//! `manifest::parse` refuses malformed `DlqReplay` manifests and names the offending field.
//!
//! Every case starts from one valid base manifest and changes one thing, by replacing one
//! snippet of its text. The replaced snippet must occur exactly once in the base, so a case can
//! never silently test the base manifest itself.
//!
//! The rules are the CRD's (`api::crd()`: schema keywords and CEL rules): the API server,
//! given the same manifest, refuses it naming the same field. That is checked here through the
//! engine the fake API server uses, against the committed `crds/dlqreplay.yaml`.
//!
//! The base manifest and the malformed cases are in [`cases`].

use dlq_replay::manifest;
use dlq_replay::manifest::structural::CrdSchema;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

mod cases;

use cases::*;

#[test]
fn the_base_manifest_parses() {
    let r = manifest::parse(BASE).unwrap_or_else(|e| panic!("base manifest refused: {e}"));
    assert_eq!(r.metadata.name.as_deref(), Some("media-replay"));
    assert_eq!(r.metadata.namespace.as_deref(), Some("media"));
    assert_eq!(
        r.spec.broker.url.as_deref(),
        Some("amqp://guest:guest@127.0.0.1:5672/%2f")
    );
    assert_eq!(r.spec.source.queue, "media.dlq");
    assert_eq!(r.spec.quarantine.queue, "media.quarantine");
    assert_eq!(r.spec.selector.limit, Some(100));
    let idem = r.spec.idempotency.as_ref().expect("idempotency");
    assert_eq!(idem.mode, dlq_replay::api::IdempotencyMode::Check);
    assert_eq!(idem.key.fields.len(), 2);
    let rate = r.spec.rate.as_ref().expect("rate");
    assert_eq!((rate.messages_per_second, rate.burst), (50, Some(10)));
    assert_eq!(r.spec.canary.wait_seconds, 60);
    // No `audit`: the keys are kept 30 days after the replay stops.
    assert_eq!(r.spec.retention_seconds(), 2_592_000);
}

/// `audit` may give only the retention: the audit trail then lives in the idempotency Redis.
#[test]
fn audit_may_give_only_the_retention() {
    let yaml = with(
        "  rate:\n",
        "  audit:\n    retentionSeconds: 86400\n  rate:\n",
    );
    let r = manifest::parse(&yaml).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.spec.retention_seconds(), 86_400);
    assert!(r.spec.audit.as_ref().is_some_and(|a| a.redis.is_none()));
    let yaml = with("  rate:\n", "  audit: {}\n  rate:\n");
    let r = manifest::parse(&yaml).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.spec.retention_seconds(), 2_592_000);
}

#[test]
fn every_malformed_manifest_is_refused_with_its_field_path() {
    let cases = cases();
    assert!(cases.len() >= 60, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        assert_ne!(c.yaml, BASE, "case {:?} does not change the base", c.name);
        match manifest::parse(&c.yaml) {
            Ok(_) => failures.push(format!("{}: parsed, but must be refused", c.name)),
            Err(e) => {
                let e = e.to_string();
                if !e.contains(c.expected) {
                    failures.push(format!(
                        "{}: error does not contain {:?}: {e}",
                        c.name, c.expected
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The committed CRD, as the fake API server (and a real one) gets it.
fn api_server_schema() -> CrdSchema {
    let crd: CustomResourceDefinition =
        serde_yaml::from_str(include_str!("../../crds/dlqreplay.yaml"))
            .expect("crds/dlqreplay.yaml");
    CrdSchema::new(&crd, "v1alpha1").expect("the CRD's schema")
}

/// What the API server says to a create of this manifest: the fields it refuses (prune,
/// default, validate, as kube-apiserver does).
fn api_server_refuses(schema: &CrdSchema, yaml: &str) -> Vec<String> {
    let mut obj: serde_json::Value = serde_yaml::from_str(yaml).expect("YAML");
    schema.prune(&mut obj);
    schema.default(&mut obj);
    schema
        .validate(&obj, None)
        .into_iter()
        .map(|v| v.field)
        .collect()
}

#[test]
fn the_api_server_refuses_the_same_manifests_naming_the_same_field() {
    let schema = api_server_schema();
    assert_eq!(
        api_server_refuses(&schema, BASE),
        Vec::<String>::new(),
        "the base manifest"
    );
    let mut failures = Vec::new();
    let mut checked = 0;
    for c in cases() {
        let field = match &c.server {
            ApiServer::NotApplicable => continue,
            ApiServer::Refuses(field) => field.to_string(),
            ApiServer::RefusesTheSameField => c
                .expected
                .split_once(':')
                .map(|(p, _)| p.to_string())
                .unwrap_or_default(),
        };
        checked += 1;
        let refused = api_server_refuses(&schema, &c.yaml);
        if !refused.contains(&field) {
            failures.push(format!("{}: refuses {refused:?}, not {field:?}", c.name));
        }
    }
    assert!(checked >= 45, "only {checked} cases checked");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// URL errors name the field but never repeat the password.
#[test]
fn url_errors_never_contain_the_password() {
    const BROKER: &str = "url: amqp://guest:guest@127.0.0.1:5672/%2f";
    const REDIS: &str = "url: redis://127.0.0.1:6379/0";
    let cases = [
        (
            "broker.url with scheme http://",
            with(BROKER, "url: http://guest:s3cr3t-pw@127.0.0.1:5672/%2f"),
            "spec.broker.url:",
        ),
        (
            "broker.url with an invalid port",
            with(BROKER, "url: amqp://guest:s3cr3t-pw@127.0.0.1:99999/%2f"),
            "spec.broker.url:",
        ),
        (
            "broker.url with a bad host",
            with(BROKER, "url: \"amqp://guest:s3cr3t-pw@[::1/%2f\""),
            "spec.broker.url:",
        ),
        (
            "broker with both url and urlSecretRef",
            with(
                BROKER,
                "url: amqp://guest:s3cr3t-pw@127.0.0.1:5672/%2f\n    urlSecretRef: {name: rabbit, key: url}",
            ),
            "spec.broker:",
        ),
        (
            "idempotency.redis.url with scheme amqp://",
            with(REDIS, "url: amqp://default:s3cr3t-pw@127.0.0.1:6379/0"),
            "spec.idempotency.redis.url:",
        ),
        (
            "idempotency.redis.url with an invalid port",
            with(REDIS, "url: redis://default:s3cr3t-pw@127.0.0.1:65536/0"),
            "spec.idempotency.redis.url:",
        ),
        (
            "broker given as a bare URL string instead of a map",
            with(
                "    url: amqp://guest:guest@127.0.0.1:5672/%2f\n",
                "",
            )
            .replacen(
                "  broker:\n",
                "  broker: amqp://guest:s3cr3t-pw@127.0.0.1:5672/%2f\n",
                1,
            ),
            "spec.broker:",
        ),
        (
            "idempotency.redis given as a bare URL string instead of a map",
            with(
                "    redis:\n      url: redis://127.0.0.1:6379/0\n",
                "    redis: redis://default:s3cr3t-pw@127.0.0.1:6379/0\n",
            ),
            "spec.idempotency.redis:",
        ),
    ];
    let schema = api_server_schema();
    for (name, yaml, path) in &cases {
        assert!(
            yaml.contains("s3cr3t-pw"),
            "{name}: the case lost its password"
        );
        // Nor does the API server's answer (the same rules, its wording).
        let mut obj: serde_json::Value = serde_yaml::from_str(yaml).expect("YAML");
        schema.prune(&mut obj);
        schema.default(&mut obj);
        let refused = schema.validate(&obj, None);
        let field = path.trim_end_matches(':');
        assert!(
            refused.iter().any(|v| v.field == field),
            "{name}: the API server does not refuse {field}: {refused:?}"
        );
        for v in &refused {
            assert!(
                !v.to_string().contains("s3cr3t-pw"),
                "{name}: the API server's error leaks the password: {v}"
            );
        }
        let e = match manifest::parse(yaml) {
            Ok(_) => panic!("{name}: parsed, but must be refused"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(path),
            "{name}: error does not name {path:?}: {e}"
        );
        assert!(
            !e.contains("s3cr3t-pw"),
            "{name}: error leaks the password: {e}"
        );
    }
}
