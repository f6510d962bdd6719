//! `kubectl kustomize deploy/` renders offline into what the operator needs, least-privilege.

use std::process::Command;

use serde_yaml::Value;

fn rendered() -> Vec<Value> {
    let out = Command::new("kubectl")
        .args(["kustomize", "deploy/"])
        .output()
        .expect("kubectl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .collect()
}

use serde::Deserialize;

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

#[test]
fn renders_every_object_the_operator_needs() {
    let docs = rendered();
    let mut kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "Deployment",
            "Namespace",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount"
        ]
    );
    let crd = of_kind(&docs, "CustomResourceDefinition")[0];
    assert_eq!(crd["metadata"]["name"], "dlqreplays.replay.dlq.dev");
}

#[test]
fn rbac_is_least_privilege() {
    let docs = rendered();
    let role = of_kind(&docs, "ClusterRole")[0];
    let rules = role["rules"].as_sequence().unwrap();
    let verbs = |resource: &str| -> Vec<String> {
        rules
            .iter()
            .filter(|r| {
                r["resources"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .any(|x| x == resource)
            })
            .flat_map(|r| {
                r["verbs"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_string())
            })
            .collect()
    };
    assert_eq!(
        verbs("secrets"),
        ["get"],
        "secrets: get only, never list or watch"
    );
    assert_eq!(verbs("dlqreplays/finalizers"), ["update"]);
    assert!(verbs("dlqreplays").contains(&"watch".to_string()));
    assert!(!verbs("dlqreplays").contains(&"delete".to_string()));
    assert!(verbs("events").contains(&"create".to_string()));
    for r in rules {
        for v in r["verbs"].as_sequence().unwrap() {
            assert_ne!(v, "*", "no wildcard verbs");
        }
        assert!(
            !r["resources"]
                .as_sequence()
                .unwrap()
                .iter()
                .any(|x| x == "*"),
            "no wildcard resources"
        );
    }
    let lease_role = of_kind(&docs, "Role")[0];
    assert_eq!(lease_role["rules"][0]["resources"][0], "leases");
}

#[test]
fn the_deployment_runs_locked_down_with_two_replicas_and_probes() {
    let docs = rendered();
    let d = of_kind(&docs, "Deployment")[0];
    assert_eq!(d["spec"]["replicas"], 2);
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"][0], "ALL");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert!(c["resources"]["limits"]["memory"].is_string());
    assert_eq!(c["args"][0], "operator");
}

/// The krew manifest installs the binary cargo builds for the plugin, and its description lists
/// exactly the plugin's verbs.
#[test]
fn the_krew_manifest_names_the_plugin_binary_and_its_verbs() {
    use clap::CommandFactory;
    let text = std::fs::read_to_string("deploy/krew/dlqreplay.yaml").unwrap();
    let m: Value = serde_yaml::from_str(&text).unwrap();
    assert_eq!(m["kind"], "Plugin");
    assert_eq!(m["metadata"]["name"], "dlqreplay");
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_kubectl-dlqreplay"));
    let platforms = m["spec"]["platforms"].as_sequence().unwrap();
    assert!(!platforms.is_empty());
    for p in platforms {
        assert_eq!(p["bin"].as_str(), bin.file_name().and_then(|n| n.to_str()));
    }
    let description = m["spec"]["description"].as_str().unwrap();
    let mut listed: Vec<&str> = description
        .lines()
        .filter_map(|l| l.trim().strip_prefix("kubectl dlqreplay "))
        .flat_map(|rest| rest.split_whitespace().next().unwrap_or("").split('|'))
        .collect();
    let mut verbs: Vec<String> = dlq_replay::plugin::Plugin::command()
        .get_subcommands()
        .map(|v| v.get_name().to_string())
        .filter(|n| n != "help")
        .collect();
    listed.sort();
    verbs.sort();
    assert_eq!(listed, verbs);
}
