//! The monitoring component: the alerts' promtool unit tests, and `kubectl kustomize` rendering it
//! alone and added to `deploy/`.

use super::*;

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
