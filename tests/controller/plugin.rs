//! `kubectl dlqreplay`: each verb run by the real `kubectl`, which finds the plugin on PATH,
//! against the cluster of the scenario (the plugin reads KUBECONFIG as kubectl does).

use super::*;

/// `kubectl dlqreplay ARGS -n NS` with the plugin's directory first on PATH: (exit code, stdout,
/// stderr). Awaited, not blocking: the fake API server answers from this test's runtime.
async fn kubectl(c: &Cluster, dir: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let plugin = std::path::Path::new(env!("CARGO_BIN_EXE_kubectl-dlqreplay"));
    let path = format!(
        "{}:{}",
        plugin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = tokio::process::Command::new("kubectl")
        .arg("dlqreplay")
        .args(args)
        .args(["-n", c.ns()])
        .env("PATH", path)
        .env("KUBECONFIG", c.kubeconfig(dir))
        .env_remove("REDIS_URL")
        .output()
        .await
        .expect("kubectl on PATH");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub(crate) async fn the_kubectl_plugin_plans_approves_suspends_resumes_retries_audits_and_reports(
    c: &Cluster,
) {
    let w = World::new("ctl-plugin").await;
    w.dead_letter((0..10).map(|i| job(&format!("k{i}"), json!({}))).collect())
        .await;
    secrets(c).await;
    let (_op, _stop) = operator(c);
    let api = replays(c);
    let dir = tempfile::tempdir().unwrap();
    let r = resource(&w, c.ns(), "plugged", "  requireApproval: true\n");
    api.create(&PostParams::default(), &r).await.unwrap();
    let waiting = wait_for(&api, "plugged", "AwaitingApproval", |r| {
        phase(r) == Some(Phase::AwaitingApproval)
    })
    .await;
    let digest = waiting.status.unwrap().plan.unwrap().digest;

    // plan: JSON for scripts, a table for people.
    let (code, out, err) = kubectl(c, dir.path(), &["plan", "plugged", "-o", "json"]).await;
    assert_eq!(code, 0, "{err}");
    let plan: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(plan["digest"], digest.as_str());
    assert_eq!(plan["counts"]["replayed"], 10);
    let (code, out, _) = kubectl(c, dir.path(), &["plan", "plugged"]).await;
    assert_eq!(code, 0);
    assert!(out.contains(&digest) && out.contains("TOTAL"), "{out}");

    // approve: a digest that is not the plan's is refused, nothing written.
    let (code, out, err) = kubectl(
        c,
        dir.path(),
        &["approve", "plugged", "--digest", "sha256:00"],
    )
    .await;
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert!(err.starts_with("error: ") && err.contains(&digest), "{err}");
    let (code, out, err) =
        kubectl(c, dir.path(), &["approve", "plugged", "--digest", &digest]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("approved"), "{out}");
    let done = wait_for(&api, "plugged", "Done", |r| phase(r) == Some(Phase::Done)).await;
    assert_eq!(done.status.unwrap().counts.replayed, 10);

    // audit and report: the trail from the replay's Redis, found through its Secret.
    let (code, out, err) = kubectl(c, dir.path(), &["audit", "plugged"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 10, "{out}");
    let (code, out, err) = kubectl(c, dir.path(), &["audit", "plugged", "--format", "csv"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 11, "a header and 10 rows: {out}");
    let (code, out, err) = kubectl(c, dir.path(), &["report", "plugged", "--format", "md"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("plugged") && out.contains("10"), "{out}");

    // suspend, resume, retry: what they set on the resource.
    let (code, _, err) = kubectl(c, dir.path(), &["suspend", "plugged"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(api.get("plugged").await.unwrap().spec.suspend);
    let (code, _, err) = kubectl(c, dir.path(), &["resume", "plugged"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(!api.get("plugged").await.unwrap().spec.suspend);
    let (code, _, err) = kubectl(c, dir.path(), &["retry", "plugged"]).await;
    assert_eq!(code, 0, "{err}");
    let annotations = api
        .get("plugged")
        .await
        .unwrap()
        .metadata
        .annotations
        .unwrap_or_default();
    assert!(
        annotations.contains_key(dlq_replay::api::RETRY_ANNOTATION),
        "{annotations:?}"
    );

    // A replay that is not there: exit 1, said on stderr.
    let (code, out, err) = kubectl(c, dir.path(), &["plan", "nope"]).await;
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert!(err.contains("not found"), "{err}");
    w.cleanup().await;
}
