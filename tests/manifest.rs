//! `manifest::parse` refuses malformed `DlqReplay` manifests and names the offending field.
//!
//! Every case starts from one valid base manifest and changes one thing, by replacing one
//! snippet of its text. The replaced snippet must occur exactly once in the base, so a case can
//! never silently test the base manifest itself.
//!
//! The rules are the CRD's (`api::crd()`: schema keywords and CEL rules): the API server,
//! given the same manifest, refuses it naming the same field. That is checked here through the
//! engine the fake API server uses, against the committed `crds/dlqreplay.yaml`.

use dlq_replay::manifest;
use dlq_replay::manifest::structural::CrdSchema;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// A valid manifest that exercises every section the cases below mutate.
const BASE: &str = r#"apiVersion: replay.dlq.dev/v1alpha1
kind: DlqReplay
metadata:
  name: media-replay
  namespace: media
spec:
  broker:
    url: amqp://guest:guest@127.0.0.1:5672/%2f
  source:
    queue: media.dlq
  quarantine:
    queue: media.quarantine
  selector:
    limit: 100
    deathReasons: [rejected]
    headers:
      x-tenant: acme
    payload:
      - pointer: /show
        equals: daily
  poison:
    maxDeathCount: 5
    requiredFields:
      - /asset/id
    jsonFields:
      - /meta
  idempotency:
    redis:
      url: redis://127.0.0.1:6379/0
    mode: Check
    key:
      fields:
        - pointer: /asset/id
        - pointer: /show
          default: none
  rate:
    messagesPerSecond: 50
    burst: 10
  canary:
    enabled: true
    waitSeconds: 60
    maxReturnRatio: 0.05
    requireDone: false
"#;

/// The base manifest with `from` (which must occur exactly once) replaced by `to`.
fn with(from: &str, to: &str) -> String {
    let n = BASE.matches(from).count();
    assert_eq!(n, 1, "{from:?} occurs {n} times in the base manifest");
    BASE.replacen(from, to, 1)
}

/// The base manifest with `snippet` (which must occur exactly once) removed.
fn without(snippet: &str) -> String {
    with(snippet, "")
}

/// One malformed manifest: its name, its text, and what the error must contain. `expected` is
/// the offending field's path followed by `:` (how every error names its field), plus, for
/// unknown and missing fields, the field's name. `server` is what the API server does with the
/// same manifest (see [`ApiServer`]).
struct Case {
    name: &'static str,
    yaml: String,
    expected: &'static str,
    server: ApiServer,
}

/// What kube-apiserver does with a case's manifest.
enum ApiServer {
    /// Refuses it (422) naming the field of `expected` (the path before its `:`).
    RefusesTheSameField,
    /// Refuses it naming this field (a missing field is `Required value` at its own path).
    Refuses(&'static str),
    /// Does not see it as the CLI does: unknown fields are pruned (or refused with 400 under
    /// `fieldValidation=Strict`), the envelope and metadata are not the schema's, and YAML's
    /// `.nan` has no JSON form to send.
    NotApplicable,
}

fn case(name: &'static str, yaml: String, expected: &'static str) -> Case {
    Case {
        name,
        yaml,
        expected,
        server: ApiServer::RefusesTheSameField,
    }
}

impl Case {
    fn server(self, server: ApiServer) -> Case {
        Case { server, ..self }
    }
}

fn cases() -> Vec<Case> {
    vec![
        // --- unknown fields
        case(
            "unknown top-level field",
            with("kind: DlqReplay\n", "kind: DlqReplay\nextra: 1\n"),
            "extra: unknown field",
        )
        .server(ApiServer::NotApplicable),
        case(
            "unknown field in spec",
            with("  rate:\n", "  dryrun: true\n  rate:\n"),
            "spec.dryrun: unknown field `dryrun`",
        )
        .server(ApiServer::NotApplicable),
        case(
            "unknown nested field spec.selector.limt",
            with("    limit: 100\n", "    limt: 100\n"),
            "spec.selector.limt: unknown field `limt`",
        )
        .server(ApiServer::NotApplicable),
        case(
            "unknown field in an idempotency key field",
            with("        - pointer: /asset/id\n", "        - pointr: /asset/id\n"),
            "spec.idempotency.key.fields[0].pointr: unknown field `pointr`",
        )
        // Pruned, and then `pointer` is missing.
        .server(ApiServer::Refuses("spec.idempotency.key.fields[0].pointer")),
        // --- wrong types
        case(
            "string for a number (rate)",
            with("messagesPerSecond: 50", "messagesPerSecond: fifty"),
            "spec.rate.messagesPerSecond: invalid type: string",
        ),
        case(
            "string for a number (canary.waitSeconds)",
            with("waitSeconds: 60", "waitSeconds: a minute"),
            "spec.canary.waitSeconds: invalid type: string",
        ),
        case(
            "list for a map (spec.source)",
            with("  source:\n    queue: media.dlq\n", "  source:\n    - media.dlq\n"),
            "spec.source: invalid type: sequence",
        ),
        case(
            "list for a map (selector.headers)",
            with("    headers:\n      x-tenant: acme\n", "    headers:\n      - x-tenant\n"),
            "spec.selector.headers: invalid type: sequence",
        ),
        case(
            "map for a list (poison.requiredFields)",
            with(
                "    requiredFields:\n      - /asset/id\n",
                "    requiredFields:\n      asset: /asset/id\n",
            ),
            "spec.poison.requiredFields: invalid type: map",
        ),
        case(
            "string for a bool (canary.enabled)",
            with("    enabled: true\n", "    enabled: sometimes\n"),
            "spec.canary.enabled: invalid type: string",
        ),
        // --- missing required fields
        case(
            "missing spec.source",
            without("  source:\n    queue: media.dlq\n"),
            "spec: missing field `source`",
        )
        .server(ApiServer::Refuses("spec.source")),
        case(
            "missing spec.source.queue",
            with("  source:\n    queue: media.dlq\n", "  source: {}\n"),
            "spec.source: missing field `queue`",
        )
        .server(ApiServer::Refuses("spec.source.queue")),
        case(
            "missing spec.quarantine",
            without("  quarantine:\n    queue: media.quarantine\n"),
            "spec: missing field `quarantine`",
        )
        .server(ApiServer::Refuses("spec.quarantine")),
        case(
            "missing spec.idempotency.key",
            without(
                "    key:\n      fields:\n        - pointer: /asset/id\n        - pointer: /show\n          default: none\n",
            ),
            "spec.idempotency: missing field `key`",
        )
        .server(ApiServer::Refuses("spec.idempotency.key")),
        case(
            "missing metadata.name",
            without("  name: media-replay\n"),
            "metadata.name:",
        )
        .server(ApiServer::NotApplicable),
        case(
            "empty metadata.name",
            with("  name: media-replay\n", "  name: \"\"\n"),
            "metadata.name:",
        )
        .server(ApiServer::NotApplicable),
        case(
            "empty spec.source.queue",
            with("    queue: media.dlq\n", "    queue: \"\"\n"),
            "spec.source.queue:",
        ),
        // --- numbers out of range
        case(
            "rate 0",
            with("messagesPerSecond: 50", "messagesPerSecond: 0"),
            "spec.rate.messagesPerSecond:",
        ),
        case(
            "burst 0",
            with("burst: 10", "burst: 0"),
            "spec.rate.burst:",
        ),
        case(
            "negative selector.limit",
            with("limit: 100", "limit: -1"),
            "spec.selector.limit:",
        ),
        case(
            "selector.limit 0",
            with("limit: 100", "limit: 0"),
            "spec.selector.limit:",
        ),
        case(
            "canary.waitSeconds 4",
            with("waitSeconds: 60", "waitSeconds: 4"),
            "spec.canary.waitSeconds:",
        ),
        case(
            "canary.waitSeconds 1801",
            with("waitSeconds: 60", "waitSeconds: 1801"),
            "spec.canary.waitSeconds:",
        ),
        case(
            "canary.maxSignatures 0",
            with("maxReturnRatio: 0.05", "maxReturnRatio: 0.05\n    maxSignatures: 0"),
            "spec.canary.maxSignatures:",
        ),
        case(
            "canary.maxReturnRatio 1.5",
            with("maxReturnRatio: 0.05", "maxReturnRatio: 1.5"),
            "spec.canary.maxReturnRatio:",
        ),
        case(
            "canary.maxReturnRatio NaN",
            with("maxReturnRatio: 0.05", "maxReturnRatio: .nan"),
            "spec.canary.maxReturnRatio:",
        )
        .server(ApiServer::NotApplicable),
        case(
            "negative poison.maxQuarantineRatio",
            with("    maxDeathCount: 5\n", "    maxDeathCount: 5\n    maxQuarantineRatio: -0.1\n"),
            "spec.poison.maxQuarantineRatio:",
        ),
        // --- JSON pointers
        case(
            "selector.payload pointer without leading slash",
            with(
                "pointer: /show\n        equals: daily",
                "pointer: show\n        equals: daily",
            ),
            "spec.selector.payload[0].pointer:",
        ),
        case(
            "selector.payload pointer with a bad ~ escape",
            with(
                "pointer: /show\n        equals: daily",
                "pointer: /sh~2ow\n        equals: daily",
            ),
            "spec.selector.payload[0].pointer:",
        ),
        case(
            "poison.requiredFields pointer without leading slash",
            with("      - /asset/id\n", "      - asset/id\n"),
            "spec.poison.requiredFields[0]:",
        ),
        case(
            "poison.requiredFields pointer with a trailing ~",
            with("      - /asset/id\n", "      - /asset/id~\n"),
            "spec.poison.requiredFields[0]:",
        ),
        case(
            "poison.jsonFields pointer without leading slash",
            with("      - /meta\n", "      - meta\n"),
            "spec.poison.jsonFields[0]:",
        ),
        case(
            "idempotency key field pointer without leading slash",
            with("        - pointer: /asset/id\n", "        - pointer: asset/id\n"),
            "spec.idempotency.key.fields[0].pointer:",
        ),
        case(
            "idempotency key field pointer with a bad ~ escape",
            with("        - pointer: /show\n", "        - pointer: /sh~ow\n"),
            "spec.idempotency.key.fields[1].pointer:",
        ),
        // --- URLs
        case(
            "broker.url not a URL",
            with(
                "url: amqp://guest:guest@127.0.0.1:5672/%2f",
                "url: not a url",
            ),
            "spec.broker.url:",
        ),
        case(
            "broker.url with scheme http://",
            with(
                "url: amqp://guest:guest@127.0.0.1:5672/%2f",
                "url: http://guest:guest@127.0.0.1:5672/%2f",
            ),
            "spec.broker.url:",
        ),
        case(
            "broker.url without a host",
            with(
                "url: amqp://guest:guest@127.0.0.1:5672/%2f",
                "url: amqp:///%2f",
            ),
            "spec.broker.url:",
        ),
        case(
            "idempotency.redis.url not a URL",
            with("url: redis://127.0.0.1:6379/0", "url: 127.0.0.1:6379"),
            "spec.idempotency.redis.url:",
        ),
        case(
            "idempotency.redis.url with scheme http://",
            with("url: redis://127.0.0.1:6379/0", "url: http://127.0.0.1:6379/0"),
            "spec.idempotency.redis.url:",
        ),
        case(
            "broker with both url and urlSecretRef",
            with(
                "    url: amqp://guest:guest@127.0.0.1:5672/%2f\n",
                "    url: amqp://guest:guest@127.0.0.1:5672/%2f\n    urlSecretRef: {name: rabbit, key: url}\n",
            ),
            "spec.broker:",
        ),
        case(
            "idempotency.redis with both url and urlSecretRef",
            with(
                "      url: redis://127.0.0.1:6379/0\n",
                "      url: redis://127.0.0.1:6379/0\n      urlSecretRef: {name: redis, key: url}\n",
            ),
            "spec.idempotency.redis:",
        ),
        case(
            "broker with neither url nor urlSecretRef",
            with("    url: amqp://guest:guest@127.0.0.1:5672/%2f\n", "    {}\n")
                .replacen("  broker:\n    {}\n", "  broker: {}\n", 1),
            "spec.broker:",
        ),
        case(
            "idempotency.redis with neither url nor urlSecretRef",
            with("    redis:\n      url: redis://127.0.0.1:6379/0\n", "    redis: {}\n"),
            "spec.idempotency.redis:",
        ),
        case(
            "broker.urlSecretRef with an empty key",
            with(
                "    url: amqp://guest:guest@127.0.0.1:5672/%2f\n",
                "    urlSecretRef: {name: rabbit, key: \"\"}\n",
            ),
            "spec.broker.urlSecretRef.key:",
        ),
        case(
            "audit.redis with both url and urlSecretRef",
            with(
                "  rate:\n",
                "  audit:\n    redis: {url: \"redis://127.0.0.1:6379/1\", urlSecretRef: {name: redis, key: url}}\n  rate:\n",
            ),
            "spec.audit.redis:",
        ),
        case(
            "audit.redis.url with scheme amqp://",
            with(
                "  rate:\n",
                "  audit:\n    redis: {url: \"amqp://127.0.0.1:6379/1\"}\n  rate:\n",
            ),
            "spec.audit.redis.url:",
        ),
        case(
            "audit.retentionSeconds under an hour",
            with("  rate:\n", "  audit:\n    retentionSeconds: 600\n  rate:\n"),
            "spec.audit.retentionSeconds:",
        ),
        case(
            "audit.retentionSeconds past ten years",
            with("  rate:\n", "  audit:\n    retentionSeconds: 400000000\n  rate:\n"),
            "spec.audit.retentionSeconds:",
        ),
        case(
            "broker.urlSecretRef with an empty name",
            with(
                "    url: amqp://guest:guest@127.0.0.1:5672/%2f\n",
                "    urlSecretRef: {name: \"\", key: url}\n",
            ),
            "spec.broker.urlSecretRef.name:",
        ),
        // --- envelope
        case(
            "wrong apiVersion",
            with(
                "apiVersion: replay.dlq.dev/v1alpha1",
                "apiVersion: replay.dlq.dev/v1",
            ),
            "apiVersion:",
        )
        .server(ApiServer::NotApplicable),
        case(
            "missing apiVersion",
            without("apiVersion: replay.dlq.dev/v1alpha1\n"),
            "apiVersion:",
        )
        .server(ApiServer::NotApplicable),
        case(
            "wrong kind",
            with("kind: DlqReplay", "kind: DlqReplays"),
            "kind:",
        )
        .server(ApiServer::NotApplicable),
        // --- cross-field rules
        case(
            "quarantine queue equal to source queue",
            with("    queue: media.quarantine\n", "    queue: media.dlq\n"),
            "spec.quarantine.queue:",
        ),
        case(
            "requireDone with idempotency.mode Claim",
            with("requireDone: false", "requireDone: true")
                .replacen("mode: Check", "mode: Claim", 1),
            "spec.canary.requireDone:",
        ),
        case(
            "requireDone without an idempotency gate",
            without(
                "  idempotency:\n    redis:\n      url: redis://127.0.0.1:6379/0\n    mode: Check\n    key:\n      fields:\n        - pointer: /asset/id\n        - pointer: /show\n          default: none\n",
            )
            .replacen("requireDone: false", "requireDone: true", 1),
            "spec.canary.requireDone:",
        ),
        case(
            "selector.payload condition without equals or in",
            with(
                "pointer: /show\n        equals: daily",
                "pointer: /show",
            ),
            "spec.selector.payload[0]:",
        ),
        case(
            "selector.payload condition with an empty in",
            with(
                "pointer: /show\n        equals: daily",
                "pointer: /show\n        in: []",
            ),
            "spec.selector.payload[0].in:",
        ),
        // --- idempotency
        case(
            "idempotency key without fields",
            with(
                "      fields:\n        - pointer: /asset/id\n        - pointer: /show\n          default: none\n",
                "      fields: []\n",
            ),
            "spec.idempotency.key.fields:",
        ),
        case(
            "empty idempotency.doneValue",
            with("    mode: Check\n", "    mode: Check\n    doneValue: \"\"\n"),
            "spec.idempotency.doneValue:",
        ),
        case(
            "idempotency.ttlSeconds 0",
            with("    mode: Check\n", "    mode: Check\n    ttlSeconds: 0\n"),
            "spec.idempotency.ttlSeconds:",
        ),
        // --- canary (with "rate 0", "quarantine queue equal to source queue", "idempotency key
        // field pointer without leading slash" and "broker with both url and urlSecretRef"
        // above: the five specs a real API server admitted before the CRD carried the rules)
        case(
            "canary.waitSeconds 0",
            with("waitSeconds: 60", "waitSeconds: 0"),
            "spec.canary.waitSeconds:",
        ),
        case(
            "empty canary.signatureHeader",
            with("    enabled: true\n", "    enabled: true\n    signatureHeader: \"\"\n"),
            "spec.canary.signatureHeader:",
        ),
        // --- selector
        case(
            "selector.deathReasons with a reason RabbitMQ never records",
            with("deathReasons: [rejected]", "deathReasons: [reject]"),
            "spec.selector.deathReasons[0]:",
        ),
        // --- enums
        case(
            "unknown idempotency.mode",
            with("mode: Check", "mode: Skip"),
            "spec.idempotency.mode: unknown variant `Skip`",
        )
        .server(ApiServer::Refuses("spec.idempotency.mode")),
        case(
            "idempotency.mode in the wrong case",
            with("mode: Check", "mode: check"),
            "spec.idempotency.mode: unknown variant `check`",
        )
        .server(ApiServer::Refuses("spec.idempotency.mode")),
    ]
}

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
        serde_yaml::from_str(include_str!("../crds/dlqreplay.yaml")).expect("crds/dlqreplay.yaml");
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
