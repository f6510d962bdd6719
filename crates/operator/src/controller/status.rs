//! Client-free status logic: conditions from a phase, the server-side apply body, when to write,
//! which failed writes to try again, and phase-change events.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::Resource;

use crate::api::{CanaryResult, CanaryStatus, DlqReplay, DlqReplayStatus, Phase, ReplayStatus};

/// Now, as conditions say it.
pub fn now() -> Time {
    let micros = chrono::Utc::now().timestamp_micros();
    Time(k8s_openapi::jiff::Timestamp::from_microsecond(micros).unwrap_or_default())
}

/// The conditions of a status, each with the `observedGeneration` it was computed for;
/// `lastTransitionTime` is kept while a condition's status does not change.
///
/// | phase                        | Ready | Reconciling | Stalled | Progressing | Degraded |
/// |------------------------------|-------|-------------|---------|-------------|----------|
/// | Pending, AwaitingApproval    | False | True        | False   | False       | False    |
/// | Canary, Draining             | False | True        | False   | True        | False    |
/// | Done                         | True  | False       | False   | False       | False    |
/// | Failed (InvalidSpec too), CanaryFailed | False | False | True | False     | True     |
/// | Suspended                    | False | False       | False   | False       | False    |
///
/// `Ready`, `Reconciling` and `Stalled` are the conditions kstatus (Flux, `kubectl wait`,
/// cli-utils) reads: `Reconciling` and `Stalled` have abnormal-true polarity, so a Done replay
/// is Current, a running or waiting one InProgress and a failed one Failed. A Suspended replay
/// is none of them (kstatus knows no suspension): it is Current but not Ready, and its phase
/// says why. `Progressing` and `Degraded` are kept as they were (older readers use them).
pub fn conditions(
    status: &DlqReplayStatus,
    previous: &[Condition],
    generation: Option<i64>,
    now: &Time,
) -> Vec<Condition> {
    let phase = status.phase.unwrap_or(Phase::Pending);
    let message = status.message.clone().unwrap_or_default();
    let reason = reason_of(status);
    let wanted = [
        ("Ready", phase == Phase::Done),
        (
            "Progressing",
            matches!(phase, Phase::Canary | Phase::Draining),
        ),
        (
            "Degraded",
            matches!(phase, Phase::Failed | Phase::CanaryFailed),
        ),
        (
            "Reconciling",
            matches!(
                phase,
                Phase::Pending | Phase::AwaitingApproval | Phase::Canary | Phase::Draining
            ),
        ),
        (
            "Stalled",
            matches!(phase, Phase::Failed | Phase::CanaryFailed),
        ),
    ];
    wanted
        .iter()
        .map(|(type_, on)| {
            let value = if *on { "True" } else { "False" };
            let since = previous
                .iter()
                .find(|c| c.type_ == *type_ && c.status == value)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| now.clone());
            Condition {
                type_: (*type_).into(),
                status: value.into(),
                reason: reason.clone(),
                message: message.clone(),
                last_transition_time: since,
                observed_generation: generation,
            }
        })
        .collect()
}

/// The body of the server-side apply of a status: the whole status.
pub fn apply_body(status: &DlqReplayStatus) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": DlqReplay::api_version(&()),
        "kind": DlqReplay::kind(&()),
        "status": status,
    })
}

/// Whether a failed write may succeed if sent again: the API server did not answer, was
/// overloaded or failing (429, 5xx), or a conflict; not when it refused the write itself (the
/// object is gone, forbidden, invalid).
pub fn worth_retrying(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code == 409 || s.code == 429 || s.code >= 500,
        kube::Error::SerdeError(_) | kube::Error::BuildRequest(_) => false,
        _ => true,
    }
}

/// When the replay stopped during its canary wait (canaries still `Waiting`): what that means
/// for the messages and for the resume.
pub fn canary_wait_note(status: &ReplayStatus) -> Option<String> {
    let waiting = status
        .canary
        .iter()
        .filter(|c| c.result == CanaryResult::Waiting)
        .count();
    (waiting > 0).then(|| {
        format!(
            "it stopped during the canary wait with {waiting} canaries out (published, acked and audited) and their verdict not in: resuming sends their signatures new canaries (signatures already decided keep their verdicts)"
        )
    })
}

/// When the status's phase began (Unix seconds), as its conditions tell: the latest of their
/// `lastTransitionTime`s, since every phase change flips at least one of them (see
/// [`conditions`]) and the API server keeps them across operator restarts and leader changes.
/// `None` where that is not the phase's own start: a status without conditions, and Draining
/// after a canary phase (the two phases have the same conditions).
pub fn phase_since(status: &DlqReplayStatus) -> Option<i64> {
    if status.phase == Some(Phase::Draining) && !status.canary.is_empty() {
        return None;
    }
    status
        .conditions
        .iter()
        .map(|c| c.last_transition_time.0.as_second())
        .max()
}

/// A CamelCase reason: the prefix of the message when it has one (`NoConsumer: ...`), else
/// the phase.
pub fn reason_of(status: &DlqReplayStatus) -> String {
    let phase = status.phase.unwrap_or(Phase::Pending).to_string();
    let Some(msg) = &status.message else {
        return phase;
    };
    match msg.split_once(':') {
        Some((head, _)) if !head.is_empty() && head.chars().all(|c| c.is_ascii_alphanumeric()) => {
            head.to_string()
        }
        _ => phase,
    }
}

/// Whether a new status must be written now: on any phase or canary change at once, else at
/// most once per interval (so a 100,000-message drain does not make 100,000 writes).
pub fn should_write(
    last: Option<&ReplayStatus>,
    next: &ReplayStatus,
    since_last_ms: u128,
    interval_ms: u128,
) -> bool {
    match last {
        None => true,
        Some(l) if l.phase != next.phase || l.canary != next.canary => true,
        Some(l) => l != next && since_last_ms >= interval_ms,
    }
}

/// Canaries whose result changed to a decision since the last written status: one event each.
pub fn canary_changes(
    old: &[CanaryStatus],
    new: &[CanaryStatus],
) -> Vec<(String, CanaryResult, Option<String>)> {
    new.iter()
        .filter(|c| c.result != CanaryResult::Waiting)
        .filter(|c| {
            !old.iter()
                .any(|o| o.signature == c.signature && o.result == c.result)
        })
        .map(|c| (c.signature.clone(), c.result, c.reason.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(phase: Phase, message: &str) -> DlqReplayStatus {
        DlqReplayStatus::from(ReplayStatus {
            phase: Some(phase),
            message: Some(message.into()),
            ..Default::default()
        })
    }

    fn t(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + secs).unwrap())
    }

    #[test]
    fn a_phase_begins_when_its_conditions_last_changed() {
        // A replay's life, one status write per step: (phase, at, its phase's start).
        let life = [
            (Phase::Pending, 0, Some(0)),
            (Phase::Pending, 60, Some(0)),
            (Phase::Suspended, 100, Some(100)),
            (Phase::Pending, 200, Some(200)),
            (Phase::Canary, 300, Some(300)),
            (Phase::Draining, 400, None),
            (Phase::Done, 500, Some(500)),
        ];
        let mut s = st(Phase::Pending, "");
        for (phase, at, since) in life {
            s.phase = Some(phase);
            if phase == Phase::Canary {
                s.canary = vec![CanaryStatus::default()];
            }
            s.conditions = conditions(&s, &s.conditions, Some(1), &t(at));
            let want = since.map(|x| t(x).0.as_second());
            assert_eq!(phase_since(&s), want, "{phase} at {at}");
        }
        // Without a canary, Draining's conditions are its own.
        let mut s = st(Phase::Pending, "");
        s.conditions = conditions(&s, &[], Some(1), &t(0));
        s.phase = Some(Phase::Draining);
        s.conditions = conditions(&s, &s.conditions, Some(1), &t(50));
        assert_eq!(phase_since(&s), Some(t(50).0.as_second()));
        assert_eq!(phase_since(&DlqReplayStatus::default()), None);
    }

    #[test]
    fn done_is_ready_and_failed_is_degraded() {
        let c = conditions(&st(Phase::Done, "ok"), &[], Some(3), &t(1));
        assert!(c.iter().all(|c| c.observed_generation == Some(3)));
        assert_eq!(
            c.iter().find(|c| c.type_ == "Ready").unwrap().status,
            "True"
        );
        let c = conditions(&st(Phase::CanaryFailed, "x"), &[], Some(3), &t(1));
        assert_eq!(
            c.iter().find(|c| c.type_ == "Degraded").unwrap().status,
            "True"
        );
        assert_eq!(
            c.iter().find(|c| c.type_ == "Ready").unwrap().status,
            "False"
        );
    }

    /// The condition `type_` of `phase`: True or False.
    fn condition_of(phase: Phase, type_: &str) -> String {
        conditions(&st(phase, "x"), &[], Some(1), &t(0))
            .into_iter()
            .find(|c| c.type_ == type_)
            .map(|c| c.status)
            .unwrap_or_else(|| panic!("no {type_} condition for {phase}"))
    }

    #[test]
    fn kstatus_reads_each_phase_right() {
        // (phase, Ready, Reconciling, Stalled): kstatus' Current, InProgress, Failed.
        let table = [
            (Phase::Pending, "False", "True", "False"),
            (Phase::Canary, "False", "True", "False"),
            (Phase::Draining, "False", "True", "False"),
            (Phase::Done, "True", "False", "False"),
            (Phase::Failed, "False", "False", "True"),
            (Phase::CanaryFailed, "False", "False", "True"),
            (Phase::Suspended, "False", "False", "False"),
            (Phase::AwaitingApproval, "False", "True", "False"),
        ];
        // Every phase is in the table (a new one must be placed).
        let schema = serde_json::to_value(schemars::schema_for!(Phase)).unwrap();
        let names: Vec<String> = schema["enum"]
            .as_array()
            .or_else(|| schema["oneOf"].as_array())
            .unwrap()
            .iter()
            .map(|v| {
                v.as_str()
                    .map(String::from)
                    .or_else(|| v["enum"][0].as_str().map(String::from))
                    .or_else(|| v["const"].as_str().map(String::from))
                    .unwrap()
            })
            .collect();
        assert_eq!(names.len(), table.len(), "{names:?}");
        for name in &names {
            assert!(
                table.iter().any(|(p, ..)| p.to_string() == *name),
                "phase {name} has no row"
            );
        }
        for (phase, ready, reconciling, stalled) in table {
            assert_eq!(condition_of(phase, "Ready"), ready, "{phase} Ready");
            assert_eq!(
                condition_of(phase, "Reconciling"),
                reconciling,
                "{phase} Reconciling"
            );
            assert_eq!(condition_of(phase, "Stalled"), stalled, "{phase} Stalled");
            // Never two of kstatus' three at once.
            let on = [ready, reconciling, stalled]
                .iter()
                .filter(|s| **s == "True")
                .count();
            assert!(on <= 1, "{phase}");
        }
        // The older conditions stay as they were.
        assert_eq!(condition_of(Phase::Draining, "Progressing"), "True");
        assert_eq!(condition_of(Phase::Pending, "Progressing"), "False");
        assert_eq!(condition_of(Phase::Failed, "Degraded"), "True");
        // An invalid spec is Failed with reason InvalidSpec: Stalled, with that reason.
        let c = conditions(
            &st(Phase::Failed, "InvalidSpec: spec.x is bad"),
            &[],
            Some(2),
            &t(0),
        );
        let stalled = c.iter().find(|c| c.type_ == "Stalled").unwrap();
        assert_eq!(
            (stalled.status.as_str(), stalled.reason.as_str()),
            ("True", "InvalidSpec")
        );
        assert_eq!(stalled.observed_generation, Some(2));
    }

    #[test]
    fn transition_time_is_kept_while_status_holds() {
        let first = conditions(&st(Phase::Draining, "a"), &[], Some(1), &t(1));
        // Through JSON and back, as a read of the object gives them.
        let stored: Vec<Condition> =
            serde_json::from_value(serde_json::to_value(&first).unwrap()).unwrap();
        assert_eq!(stored, first);
        let second = conditions(&st(Phase::Draining, "b"), &stored, Some(1), &t(2));
        let p = second.iter().find(|c| c.type_ == "Progressing").unwrap();
        assert_eq!(p.last_transition_time, t(1));
        let third = conditions(&st(Phase::Done, "c"), &second, Some(1), &t(3));
        assert_eq!(
            third
                .iter()
                .find(|c| c.type_ == "Progressing")
                .unwrap()
                .last_transition_time,
            t(3)
        );
    }

    #[test]
    fn the_apply_body_is_the_whole_status_with_conditions_of_their_generation() {
        let mut s = st(Phase::Draining, "replaying");
        s.counts.replayed = 7;
        s.conditions = conditions(&s, &[], Some(2), &t(0));
        let body = apply_body(&s);
        assert_eq!(body["apiVersion"], "replay.dlq.dev/v1alpha1");
        assert_eq!(body["kind"], "DlqReplay");
        assert_eq!(body["status"]["counts"]["replayed"], 7);
        assert_eq!(body["status"]["conditions"][1]["type"], "Progressing");
        assert_eq!(body["status"]["conditions"][1]["observedGeneration"], 2);
        assert_eq!(
            body["status"]["conditions"][1]["lastTransitionTime"],
            "2027-01-15T08:00:00Z"
        );
    }

    #[test]
    fn only_writes_that_may_pass_are_tried_again() {
        let api = |code: u16| {
            kube::Error::Api(
                kube::core::Status::failure("x", "y")
                    .with_code(code)
                    .boxed(),
            )
        };
        assert!(worth_retrying(&api(503)));
        assert!(worth_retrying(&api(429)));
        assert!(worth_retrying(&api(409)));
        assert!(!worth_retrying(&api(404)));
        assert!(!worth_retrying(&api(422)));
        assert!(!worth_retrying(&api(403)));
    }

    #[test]
    fn a_stop_during_the_canary_wait_says_what_a_resume_does() {
        let mut s = st(Phase::Canary, "1 canaries out");
        assert!(canary_wait_note(&s).is_none());
        s.canary.push(CanaryStatus {
            signature: "TimeoutError".into(),
            ..Default::default()
        });
        let note = canary_wait_note(&s).unwrap();
        assert!(note.contains("1 canaries out") && note.contains("new canaries"));
    }

    #[test]
    fn reason_comes_from_the_message_prefix() {
        assert_eq!(
            reason_of(&st(Phase::Pending, "NoConsumer: no consumer on q")),
            "NoConsumer"
        );
        assert_eq!(
            reason_of(&st(Phase::Pending, "waiting for things")),
            "Pending"
        );
    }

    #[test]
    fn each_canary_decision_is_reported_once() {
        let c = |r| CanaryStatus {
            signature: "s".into(),
            result: r,
            ..Default::default()
        };
        assert!(canary_changes(&[], &[c(CanaryResult::Waiting)]).is_empty());
        assert_eq!(
            canary_changes(&[c(CanaryResult::Waiting)], &[c(CanaryResult::DiedAgain)]).len(),
            1
        );
        assert!(
            canary_changes(&[c(CanaryResult::DiedAgain)], &[c(CanaryResult::DiedAgain)]).is_empty()
        );
    }

    #[test]
    fn writes_are_throttled_except_on_phase_changes() {
        let a = st(Phase::Draining, "1");
        let mut b = a.clone();
        b.counts.replayed = 5;
        assert!(should_write(None, &a, 0, 2000));
        assert!(!should_write(Some(&a), &b, 100, 2000));
        assert!(should_write(Some(&a), &b, 2000, 2000));
        assert!(should_write(Some(&a), &st(Phase::Done, "1"), 1, 2000));
        assert!(!should_write(Some(&a), &a, 5000, 2000));
    }
}
