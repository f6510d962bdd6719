//! Client-free status logic: conditions from a phase, when to write, and phase-change events.

use crate::api::{CanaryResult, CanaryStatus, Condition, DlqReplayStatus, Phase};

/// The standard conditions of a status: `Ready` (the replay reached Done), `Progressing` (it is
/// moving), `Degraded` (it stopped short). `lastTransitionTime` is kept while a condition's
/// status does not change.
pub fn conditions(status: &DlqReplayStatus, previous: &[Condition], now: &str) -> Vec<Condition> {
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
    ];
    wanted
        .iter()
        .map(|(type_, on)| {
            let value = if *on { "True" } else { "False" };
            let since = previous
                .iter()
                .find(|c| c.type_ == *type_ && c.status == value)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| now.to_string());
            Condition {
                type_: (*type_).into(),
                status: value.into(),
                reason: reason.clone(),
                message: message.clone(),
                last_transition_time: since,
            }
        })
        .collect()
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
    last: Option<&DlqReplayStatus>,
    next: &DlqReplayStatus,
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
        DlqReplayStatus {
            phase: Some(phase),
            message: Some(message.into()),
            ..Default::default()
        }
    }

    #[test]
    fn done_is_ready_and_failed_is_degraded() {
        let c = conditions(&st(Phase::Done, "ok"), &[], "t1");
        assert_eq!(
            c.iter().find(|c| c.type_ == "Ready").unwrap().status,
            "True"
        );
        let c = conditions(&st(Phase::CanaryFailed, "x"), &[], "t1");
        assert_eq!(
            c.iter().find(|c| c.type_ == "Degraded").unwrap().status,
            "True"
        );
        assert_eq!(
            c.iter().find(|c| c.type_ == "Ready").unwrap().status,
            "False"
        );
    }

    #[test]
    fn transition_time_is_kept_while_status_holds() {
        let first = conditions(&st(Phase::Draining, "a"), &[], "t1");
        let second = conditions(&st(Phase::Draining, "b"), &first, "t2");
        let p = second.iter().find(|c| c.type_ == "Progressing").unwrap();
        assert_eq!(p.last_transition_time, "t1");
        let third = conditions(&st(Phase::Done, "c"), &second, "t3");
        assert_eq!(
            third
                .iter()
                .find(|c| c.type_ == "Progressing")
                .unwrap()
                .last_transition_time,
            "t3"
        );
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
