//! The base manifest and the malformed ones made from it (one change each), with what the CLI's
//! error must say of each and what the API server does with it.

/// A valid manifest that exercises every section the cases below mutate.
pub(crate) const BASE: &str = r#"apiVersion: replay.dlq.dev/v1alpha1
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
pub(crate) fn with(from: &str, to: &str) -> String {
    let n = BASE.matches(from).count();
    assert_eq!(n, 1, "{from:?} occurs {n} times in the base manifest");
    BASE.replacen(from, to, 1)
}

/// The base manifest with `snippet` (which must occur exactly once) removed.
pub(crate) fn without(snippet: &str) -> String {
    with(snippet, "")
}

/// One malformed manifest: its name, its text, and what the error must contain. `expected` is
/// the offending field's path followed by `:` (how every error names its field), plus, for
/// unknown and missing fields, the field's name. `server` is what the API server does with the
/// same manifest (see [`ApiServer`]).
pub(crate) struct Case {
    pub(crate) name: &'static str,
    pub(crate) yaml: String,
    pub(crate) expected: &'static str,
    pub(crate) server: ApiServer,
}

/// What kube-apiserver does with a case's manifest.
pub(crate) enum ApiServer {
    /// Refuses it (422) naming the field of `expected` (the path before its `:`).
    RefusesTheSameField,
    /// Refuses it naming this field (a missing field is `Required value` at its own path).
    Refuses(&'static str),
    /// Does not see it as the CLI does: unknown fields are pruned (or refused with 400 under
    /// `fieldValidation=Strict`), the envelope and metadata are not the schema's, and YAML's
    /// `.nan` has no JSON form to send.
    NotApplicable,
}

pub(crate) fn case(name: &'static str, yaml: String, expected: &'static str) -> Case {
    Case {
        name,
        yaml,
        expected,
        server: ApiServer::RefusesTheSameField,
    }
}

impl Case {
    pub(crate) fn server(self, server: ApiServer) -> Case {
        Case { server, ..self }
    }
}

pub(crate) fn cases() -> Vec<Case> {
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
            "broker.url, a cluster's second endpoint not a host",
            with(
                "url: amqp://guest:guest@127.0.0.1:5672/%2f",
                "url: \"amqp://guest:guest@127.0.0.1:5681,not a host/%2f\"",
            ),
            "spec.broker.url:",
        ),
        case(
            "idempotency.redis.url, a cluster URL with a bad port",
            with(
                "url: redis://127.0.0.1:6379/0",
                "url: redis+cluster://127.0.0.1:7100,127.0.0.1:99999",
            ),
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
        // --- expect (what a reviewer approved)
        case(
            "expect that approves everything",
            with("requireDone: false", "requireDone: false\n  expect: {}"),
            "spec.expect:",
        ),
        case(
            "expect with an empty list of signatures and no maximum",
            with("requireDone: false", "requireDone: false\n  expect: {signatures: []}"),
            "spec.expect:",
        ),
        case(
            "expect.maxReplayed 0",
            with("requireDone: false", "requireDone: false\n  expect: {maxReplayed: 0}"),
            "spec.expect.maxReplayed:",
        ),
        case(
            "expect.maxQuarantined below 0",
            with("requireDone: false", "requireDone: false\n  expect: {maxQuarantined: -1}"),
            "spec.expect.maxQuarantined:",
        ),
        case(
            "expect.signatures holding an empty signature",
            with("requireDone: false", "requireDone: false\n  expect: {signatures: [\"\"]}"),
            "spec.expect.signatures[0]:",
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
