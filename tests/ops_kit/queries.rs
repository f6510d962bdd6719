//! Every metric name an alert or a dashboard query reads is one the operator exports (the names
//! from its own registry, served by its `/metrics` route), read by a small PromQL reader.

use super::*;

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
            "DlqReplayAwaitingApprovalTooLong",
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
