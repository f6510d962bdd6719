//! The operations kit: `deploy/monitoring` (ServiceMonitor, PrometheusRule, Grafana dashboard)
//! and `deploy/gitops` (the Argo CD health check).
//!
//! - Every metric name an alert or a dashboard query reads is one the operator exports: the
//!   exported names come from the operator's own registry (`Metrics::new()`, each family touched,
//!   served by its `/metrics` route), not from a list written here.
//! - The alerts' promtool unit tests (`deploy/monitoring/tests/rules.test.yaml`) pass, when
//!   `promtool` is on PATH (else SKIPPED, said on stderr; a failure when REQUIRE_PROMTOOL is set,
//!   as `.ci/run` does).
//! - `kubectl kustomize` renders the component alone and added to `deploy/` (SKIPPED without
//!   kubectl).
//! - The Argo CD health check (`deploy/gitops/health.lua`), run in Lua 5.1 (Argo CD's
//!   gopher-lua speaks 5.1), maps a status of
//!   every phase of `api::Phase` (taken from the type, so a new phase without a mapping fails),
//!   a missing status and a status older than the spec; the argocd-cm example holds it verbatim.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use dlq_replay::api::{CanaryResult, CanaryStatus, Counts, DlqReplayStatus, Phase, ReplayStatus};
use dlq_replay::metrics::Metrics;
use mlua::LuaSerdeExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The operator's `/metrics` text, every family touched so that each has samples.
async fn exported_text() -> String {
    let m = Metrics::new();
    let all = Counts {
        scanned: 7,
        replayed: 1,
        duplicates: 1,
        quarantined: 1,
        skipped: 1,
        failed: 1,
        returned: 2,
    };
    m.count(&Counts::default(), &all);
    m.phase_change(None, Some(Phase::Draining));
    m.retried("reconnect");
    m.publish_latency.observe(0.01);
    m.double_published.inc();
    m.leader.set(1);
    let status = DlqReplayStatus::from(ReplayStatus {
        phase: Some(Phase::Draining),
        counts: all,
        canary: vec![CanaryStatus {
            signature: "TimeoutError".into(),
            result: CanaryResult::Passed,
            ..Default::default()
        }],
        ..Default::default()
    });
    m.observe_replay("media", "ep", Some(&status), Some(0.1));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(dlq_replay::metrics::serve_on(listener, m));
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut raw = String::new();
    conn.read_to_string(&mut raw).await.unwrap();
    server.abort();
    let (_, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    body.to_string()
}

/// The sample names of the exposition, checked against the families its `# TYPE` lines
/// declare (counters end in `_total`, histograms have `_bucket`, `_sum`, `_count`): each family
/// was touched, so the names are all the operator can export.
async fn exported_names() -> BTreeSet<String> {
    let text = exported_text().await;
    let mut declared = BTreeSet::new();
    let mut samples = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (name, kind) = (it.next().unwrap(), it.next().unwrap());
            match kind {
                "counter" => {
                    declared.insert(format!("{}_total", name.trim_end_matches("_total")));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        declared.insert(format!("{name}{s}"));
                    }
                }
                _ => {
                    declared.insert(name.to_string());
                }
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            samples.insert(line[..end].to_string());
        }
    }
    assert_eq!(
        declared, samples,
        "a family without samples (touch it above) or a sample of no family:\n{text}"
    );
    assert!(samples.iter().all(|n| n.starts_with("dlq_replay_")));
    samples
}

/// PromQL's aggregation operators: `max by (x) (...)` puts a clause between one and its `(`.
const AGGREGATIONS: [&str; 12] = [
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

const KEYWORDS: [&str; 13] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
];

/// The metric names a PromQL expression reads: the identifiers left once strings, label
/// matchers (`{...}`), ranges (`[...]`), the label lists of `by`/`without`/`on`/`ignoring`/
/// `group_left`/`group_right`, Grafana variables, keywords, numbers and function calls are
/// taken out. `label_values(metric{...}, label)` (a Grafana variable query) reads `metric`.
fn metric_names(expr: &str) -> BTreeSet<String> {
    // Strings and Grafana variables out first: a matcher's value may hold anything.
    let mut plain = String::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' | '`' => {
                let mut escaped = false;
                for d in chars.by_ref() {
                    if !escaped && d == c {
                        break;
                    }
                    escaped = !escaped && d == '\\' && c != '`';
                }
                plain.push_str("\"\"");
            }
            '$' => {
                while chars
                    .peek()
                    .is_some_and(|d| d.is_ascii_alphanumeric() || *d == '_')
                {
                    chars.next();
                }
            }
            _ => plain.push(c),
        }
    }
    // Matchers and ranges.
    let mut flat = String::new();
    let mut depth = 0;
    for c in plain.chars() {
        match c {
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            _ if depth == 0 => flat.push(c),
            _ => {}
        }
    }
    let bytes: Vec<char> = flat.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut skip_label_list = false;
    let mut in_label_values = false;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_' || bytes[i] == ':')
            {
                i += 1;
            }
            let word: String = bytes[start..i].iter().collect();
            let mut j = i;
            while j < bytes.len() && bytes[j].is_whitespace() {
                j += 1;
            }
            let called = j < bytes.len() && bytes[j] == '(';
            let lower = word.to_ascii_lowercase();
            if KEYWORDS.contains(&lower.as_str()) {
                if !matches!(lower.as_str(), "and" | "or" | "unless" | "bool" | "offset") && called
                {
                    skip_label_list = true;
                }
            } else if called || AGGREGATIONS.contains(&word.as_str()) {
                in_label_values = word == "label_values";
            } else if skip_label_list {
                // a label of `by (...)` and the like
            } else if in_label_values {
                names.insert(word);
                in_label_values = false;
                // the label after the comma is not a metric
                while i < bytes.len() && bytes[i] != ')' {
                    i += 1;
                }
            } else {
                names.insert(word);
            }
            continue;
        }
        if c == ')' {
            skip_label_list = false;
        }
        if c.is_ascii_digit() || c == '.' {
            // numbers and durations (`5m`, `1e3`)
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '.') {
                i += 1;
            }
            continue;
        }
        i += 1;
    }
    names
}

#[test]
fn the_promql_reader_finds_the_metrics_and_only_them() {
    let got = metric_names(
        r#"(max by (namespace, name) (a_total{of="x}", name=~"$replay"}) / ignoring(of) b[5m] offset 1h) > on (namespace) group_left (phase) c and absent(d) or vector(0) * 1e3 + time() - e{x="by (y)"}"#,
    );
    let want: BTreeSet<String> = ["a_total", "b", "c", "d", "e"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        metric_names(r#"label_values(m_total{namespace=~"$namespace"}, name)"#),
        BTreeSet::from(["m_total".to_string()])
    );
    assert_eq!(
        metric_names("histogram_quantile(0.99, sum by (le) (rate(h_bucket[$__rate_interval])))"),
        BTreeSet::from(["h_bucket".to_string()])
    );
}

/// Every string under the key `key`, anywhere in `v`.
fn strings_under(v: &Value, key: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                match x {
                    Value::String(s) if k == key => out.push(s.clone()),
                    _ => strings_under(x, key, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| strings_under(x, key, out)),
        _ => {}
    }
}

fn rules() -> serde_yaml::Value {
    serde_yaml::from_str(&read("deploy/monitoring/prometheusrule.yaml")).expect("YAML")
}

#[tokio::test]
async fn the_alerts_read_only_metrics_the_operator_exports() {
    let exported = exported_names().await;
    let rule = rules();
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["kind"], "PrometheusRule");
    let mut alerts = Vec::new();
    for group in rule["spec"]["groups"].as_sequence().expect("groups") {
        for r in group["rules"].as_sequence().expect("rules") {
            let name = r["alert"].as_str().expect("an alert").to_string();
            let expr = r["expr"].as_str().expect("an expr");
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{name}: no metric in {expr}");
            for n in &names {
                assert!(
                    exported.contains(n),
                    "{name} reads {n}, which the operator does not export; it exports {exported:?}"
                );
            }
            for a in ["summary", "description"] {
                assert!(r["annotations"][a].is_string(), "{name}: no {a}");
            }
            alerts.push(name);
        }
    }
    assert_eq!(
        alerts,
        [
            "DlqReplayQuarantineRatioHigh",
            "DlqReplayDoublePublished",
            "DlqReplayFailed",
            "DlqReplayPendingTooLong",
            "DlqReplayNoLeader"
        ]
    );
    eprintln!(
        "{} alerts read only exported metrics ({} exported)",
        alerts.len(),
        exported.len()
    );
}

#[tokio::test]
async fn the_dashboard_queries_only_metrics_the_operator_exports() {
    let exported = exported_names().await;
    let dash: Value = serde_json::from_str(&read("deploy/monitoring/dashboard.json")).unwrap();
    let mut exprs = Vec::new();
    strings_under(&dash["panels"], "expr", &mut exprs);
    strings_under(&dash["templating"], "definition", &mut exprs);
    let panels = dash["panels"].as_array().unwrap();
    assert!(
        panels
            .iter()
            .all(|p| !p["targets"].as_array().is_none_or(|t| t.is_empty())),
        "a panel without a query"
    );
    let mut read_names = BTreeSet::new();
    for expr in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "no metric in {expr}");
        for n in names {
            assert!(
                exported.contains(&n),
                "the dashboard reads {n} ({expr}), which the operator does not export"
            );
            read_names.insert(n);
        }
    }
    // What the issue asks to see: drain rate, decisions, canaries, returns, publish latency,
    // per replay.
    for (what, needle) in [
        (
            "drain rate",
            r#"dlq_replay_replay_messages_total{of="replayed""#,
        ),
        (
            "decisions by kind",
            "sum by (decision) (rate(dlq_replay_messages_total",
        ),
        ("canary results", "dlq_replay_replay_canaries"),
        (
            "returns",
            r#"dlq_replay_replay_messages_total{of="returned""#,
        ),
        (
            "publish latency",
            "dlq_replay_publish_latency_seconds_bucket",
        ),
    ] {
        assert!(exprs.iter().any(|e| e.contains(needle)), "no {what} panel");
    }
    eprintln!(
        "{} dashboard queries in {} panels read {} exported metrics",
        exprs.len(),
        panels.len(),
        read_names.len()
    );
}

fn on_path(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn the_alerts_pass_their_promtool_unit_tests() {
    if !on_path("promtool") {
        assert!(
            std::env::var_os("REQUIRE_PROMTOOL").is_none(),
            "REQUIRE_PROMTOOL is set but promtool is not on PATH (.ci/services installs it)"
        );
        eprintln!(
            "SKIPPED: promtool not on PATH (Debian: the `prometheus` package; deploy/monitoring/tests/rules.test.yaml not run)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = serde_yaml::to_string(&rules()["spec"]).unwrap();
    std::fs::write(dir.path().join("rules.yaml"), spec).unwrap();
    std::fs::copy(
        root().join("deploy/monitoring/tests/rules.test.yaml"),
        dir.path().join("rules.test.yaml"),
    )
    .unwrap();
    for args in [
        ["check", "rules", "rules.yaml"],
        ["test", "rules", "rules.test.yaml"],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("promtool {}:\n{text}", args.join(" "));
        assert!(out.status.success(), "promtool {}: {text}", args.join(" "));
        assert!(text.contains("SUCCESS"), "{text}");
    }
}

fn kustomize(dir: &Path) -> String {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn kinds(yaml: &str) -> Vec<(String, String)> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| {
            let v = <serde_yaml::Value as serde::Deserialize>::deserialize(d).unwrap();
            (
                v["kind"].as_str().unwrap_or_default().to_string(),
                v["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

#[test]
fn the_monitoring_component_renders_alone_and_added_to_deploy() {
    let kubectl = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !kubectl {
        eprintln!("SKIPPED: kubectl not on PATH");
        return;
    }
    let alone = kustomize(&root().join("deploy/monitoring"));
    let mut got = kinds(&alone);
    got.sort();
    let want = [
        ("ConfigMap", "dlq-replay-dashboard"),
        ("PrometheusRule", "dlq-replay"),
        ("ServiceMonitor", "dlq-replay"),
    ]
    .map(|(k, n)| (k.to_string(), n.to_string()));
    assert_eq!(got, want);
    // The dashboard ConfigMap holds the file, labelled for Grafana's sidecar.
    let cm = serde_yaml::Deserializer::from_str(&alone)
        .map(|d| <serde_yaml::Value as serde::Deserialize>::deserialize(d).unwrap())
        .find(|v| v["kind"] == "ConfigMap")
        .unwrap();
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(
        cm["data"]["dlq-replay.json"].as_str(),
        Some(read("deploy/monitoring/dashboard.json").as_str())
    );
    // The ServiceMonitor selects the metrics Service by its labels and port name.
    let service: serde_yaml::Value = serde_yaml::from_str(&read("deploy/service.yaml")).unwrap();
    let sm: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/monitoring/servicemonitor.yaml")).unwrap();
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
        assert_eq!(&service["metadata"]["labels"][k], v);
    }
    assert_eq!(
        sm["spec"]["namespaceSelector"]["matchNames"][0],
        service["metadata"]["namespace"]
    );
    let port = &sm["spec"]["endpoints"][0]["port"];
    assert!(service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|p| &p["name"] == port));
    assert_eq!(sm["spec"]["endpoints"][0]["honorLabels"], true);

    // `components: [monitoring]` in (a copy of) deploy/kustomization.yaml.
    let dir = tempfile::tempdir().unwrap();
    let copy = |from: &Path, to: &Path| {
        let status = Command::new("cp")
            .arg("-r")
            .arg(from)
            .arg(to)
            .status()
            .unwrap();
        assert!(status.success());
    };
    copy(&root().join("deploy"), dir.path());
    copy(&root().join("crds"), dir.path());
    let k = dir.path().join("deploy/kustomization.yaml");
    let mut text = std::fs::read_to_string(&k).unwrap();
    text.push_str("components:\n  - monitoring\n");
    std::fs::write(&k, text).unwrap();
    let all = kinds(&kustomize(&dir.path().join("deploy")));
    for kind in [
        "Deployment",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
    ] {
        assert!(all.iter().any(|(k, _)| k == kind), "no {kind} in {all:?}");
    }
    eprintln!(
        "deploy/ with the monitoring component: {} objects",
        all.len()
    );
}

/// Every phase of `api::Phase`, from the type's schema (what the CRD's enum holds).
fn every_phase() -> Vec<Phase> {
    let schema = serde_json::to_value(schemars::schema_for!(Phase)).unwrap();
    let items = schema["enum"]
        .as_array()
        .or_else(|| schema["oneOf"].as_array())
        .expect("an enum schema")
        .clone();
    let phases: Vec<Phase> = items
        .iter()
        .map(|v| {
            let name = v
                .as_str()
                .or_else(|| v["const"].as_str())
                .or_else(|| v["enum"][0].as_str())
                .expect("a phase name");
            serde_json::from_value(json!(name)).unwrap()
        })
        .collect();
    assert!(phases.len() >= 7, "{phases:?}");
    phases
}

/// What Argo CD must show for a phase. A `match` without a wildcard: a new phase does not
/// compile until it is placed here (and the Lua then must map it).
fn argo_health(phase: Phase) -> &'static str {
    match phase {
        Phase::Pending | Phase::Canary | Phase::Draining => "Progressing",
        Phase::Done => "Healthy",
        Phase::Failed | Phase::CanaryFailed => "Degraded",
        Phase::Suspended => "Suspended",
    }
}

/// Run the health check on `obj` as Argo CD does (the global `obj`); its (status, message).
fn health(lua_src: &str, obj: &Value) -> (String, String) {
    let lua = mlua::Lua::new();
    let options = mlua::SerializeOptions::new()
        .serialize_none_to_null(false)
        .serialize_unit_to_null(false);
    let value = lua.to_value_with(obj, options).unwrap();
    lua.globals().set("obj", value).unwrap();
    let hs: mlua::Table = lua
        .load(lua_src)
        .set_name("health.lua")
        .eval()
        .unwrap_or_else(|e| panic!("the health check failed on {obj}: {e}"));
    let status: String = hs.get("status").unwrap();
    let message: String = hs.get("message").unwrap();
    (status, message)
}

fn replay(status: Option<Value>) -> Value {
    let mut obj = json!({
        "apiVersion": "replay.dlq.dev/v1alpha1",
        "kind": "DlqReplay",
        "metadata": {"name": "ep-fix-4411", "namespace": "media", "generation": 2},
        "spec": {},
    });
    if let Some(s) = status {
        obj["status"] = s;
    }
    obj
}

#[test]
fn the_argo_cd_health_check_maps_every_phase() {
    let lua = read("deploy/gitops/health.lua");
    let phases = every_phase();
    for phase in &phases {
        let status = DlqReplayStatus {
            replay: ReplayStatus {
                phase: Some(*phase),
                message: Some(format!("Because: {phase} for a reason")),
                counts: Counts {
                    scanned: 70,
                    replayed: 50,
                    duplicates: 10,
                    quarantined: 5,
                    skipped: 5,
                    failed: 0,
                    returned: 0,
                },
                ..Default::default()
            },
            observed_generation: Some(2),
            ..Default::default()
        };
        let obj = replay(Some(serde_json::to_value(&status).unwrap()));
        let (got, message) = health(&lua, &obj);
        assert_eq!(got, argo_health(*phase), "{phase}: {message}");
        assert!(
            message.starts_with(&format!("{phase}: Because")) && message.contains("replayed 50"),
            "{phase}: {message}"
        );
        eprintln!("{phase:>12} -> {got:<11} {message}");
        // A status older than the spec (spec.suspend just changed): Progressing, whatever the
        // phase.
        let mut stale = obj.clone();
        stale["status"]["observedGeneration"] = json!(1);
        let (got, message) = health(&lua, &stale);
        assert_eq!(got, "Progressing", "{phase} stale: {message}");
        assert!(message.contains("generation 2"), "{message}");
    }
    // No status yet, or no phase in it.
    for obj in [replay(None), replay(Some(json!({})))] {
        let (got, message) = health(&lua, &obj);
        assert_eq!(got, "Progressing", "{obj}");
        assert!(message.contains("operator"), "{message}");
    }
    // Only a phase (a status written by an older operator): still mapped.
    let (got, _) = health(&lua, &replay(Some(json!({"phase": "Done"}))));
    assert_eq!(got, "Healthy");
    // A phase this check does not know (a newer operator): Unknown, saying so.
    let (got, message) = health(&lua, &replay(Some(json!({"phase": "Warping"}))));
    assert_eq!(
        (got.as_str(), message.contains("Unknown phase Warping")),
        ("Unknown", true)
    );
    eprintln!("{} phases mapped", phases.len());
}

#[test]
fn the_argocd_cm_example_holds_the_health_check_verbatim() {
    let cm: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/gitops/argocd-cm-patch.yaml")).unwrap();
    assert_eq!(cm["kind"], "ConfigMap");
    assert_eq!(cm["metadata"]["name"], "argocd-cm");
    let key = format!(
        "resource.customizations.health.{}_{}",
        dlq_replay::api::GROUP,
        dlq_replay::api::KIND
    );
    assert_eq!(
        cm["data"][key.as_str()].as_str(),
        Some(read("deploy/gitops/health.lua").as_str()),
        "deploy/gitops/argocd-cm-patch.yaml's {key} is not deploy/gitops/health.lua"
    );
}
