//! The Argo CD health check (`deploy/gitops/health.lua`) in Lua 5.1, over every phase; the
//! argocd-cm example holds it verbatim.

use super::*;

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
        Phase::Suspended | Phase::AwaitingApproval => "Suspended",
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
