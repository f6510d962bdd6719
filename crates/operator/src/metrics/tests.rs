//! Unit tests of the metrics and health state.

use super::*;

#[test]
fn health_fails_when_a_part_died_or_stalled_and_not_after_a_clean_stop() {
    let m = Metrics::new();
    assert!(m.health().is_ok());
    m.alive("controller", None);
    m.alive("lease", Some(Duration::from_secs(60)));
    assert!(m.health().is_ok());
    m.died("controller", "it panicked");
    assert_eq!(
        m.health().unwrap_err(),
        "controller died: it panicked".to_string()
    );
    m.stopped("controller");
    assert!(m.health().is_ok());
    m.alive("lease", Some(Duration::ZERO));
    std::thread::sleep(Duration::from_millis(5));
    assert!(m.health().unwrap_err().starts_with("lease stalled"));
}

#[test]
fn a_replay_shows_its_phase_since_counts_canaries_and_ratio_until_forgotten() {
    use crate::api::{CanaryResult, CanaryStatus, DlqReplayStatus, Phase, ReplayStatus};
    let m = Metrics::new();
    let mut s = DlqReplayStatus::from(ReplayStatus {
        phase: Some(Phase::Pending),
        ..Default::default()
    });
    m.observe_replay_at("media", "ep", Some(&s), Some(0.1), 100);
    m.observe_replay_at("media", "ep", Some(&s), Some(0.1), 200);
    let text = m.encode();
    assert!(
        text.contains(r#"dlq_replay_replay_phase_since_seconds{namespace="media",name="ep",phase="Pending"} 100"#),
        "{text}"
    );
    assert!(
        text.contains(r#"dlq_replay_replay_max_quarantine_ratio{namespace="media",name="ep"} 0.1"#),
        "{text}"
    );
    s.phase = Some(Phase::Draining);
    s.counts.scanned = 10;
    s.counts.quarantined = 3;
    s.canary = vec![
        CanaryStatus {
            result: CanaryResult::Passed,
            ..Default::default()
        },
        CanaryStatus {
            result: CanaryResult::Passed,
            ..Default::default()
        },
    ];
    m.observe_replay_at("media", "ep", Some(&s), None, 300);
    let text = m.encode();
    assert!(!text.contains(r#"phase="Pending""#), "{text}");
    assert!(text.contains(r#"phase="Draining"} 300"#), "{text}");
    assert!(
        text.contains(
            r#"dlq_replay_replay_messages_total{namespace="media",name="ep",of="quarantined"} 3"#
        ),
        "{text}"
    );
    assert!(
        text.contains(
            r#"dlq_replay_replay_canaries{namespace="media",name="ep",result="Passed"} 2"#
        ),
        "{text}"
    );
    assert!(
        !text.contains("dlq_replay_replay_max_quarantine_ratio{"),
        "{text}"
    );
    // A new replay under the same name: its counts start over.
    s.counts.scanned = 4;
    s.canary.clear();
    m.observe_replay_at("media", "ep", Some(&s), None, 400);
    let text = m.encode();
    assert!(text.contains(r#"of="scanned"} 4"#), "{text}");
    assert!(!text.contains("result=\"Passed\""), "{text}");
    m.forget_replay("media", "ep");
    let text = m.encode();
    assert!(!text.contains(r#"name="ep""#), "{text}");
    m.observe_replay_at("media", "ep", Some(&s), None, 500);
    m.forget_replays();
    assert!(!m.encode().contains(r#"name="ep""#));
}

#[test]
fn a_pending_replay_keeps_its_since_across_an_operator_restart() {
    use crate::api::{DlqReplayStatus, Phase, ReplayStatus};
    use crate::controller::status;
    let at = |secs: i64| {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(secs).unwrap(),
        )
    };
    let mut s = DlqReplayStatus::from(ReplayStatus {
        phase: Some(Phase::Pending),
        ..Default::default()
    });
    s.conditions = status::conditions(&s, &[], Some(1), &at(1_000));
    // Still Pending at 1,300, when the operator wrote its status again.
    s.conditions = status::conditions(&s, &s.conditions, Some(1), &at(1_300));
    // A new operator (a restart, another leader) first sees it at 1,600.
    let m = Metrics::new();
    m.observe_replay_at("media", "ep", Some(&s), None, 1_600);
    let text = m.encode();
    assert!(
        text.contains(r#"dlq_replay_replay_phase_since_seconds{namespace="media",name="ep",phase="Pending"} 1000"#),
        "{text}"
    );
    // Never in the future, whatever the clocks say.
    let m = Metrics::new();
    m.observe_replay_at("media", "ep", Some(&s), None, 900);
    assert!(m.encode().contains(r#"phase="Pending"} 900"#));
}

#[test]
fn the_text_is_openmetrics() {
    let m = Metrics::new();
    m.leader.set(1);
    let text = m.encode();
    assert!(text.contains("dlq_replay_leader 1"), "{text}");
    assert!(text.trim_end().ends_with("# EOF"), "{text}");
    assert!(OPENMETRICS.starts_with("application/openmetrics-text; version=1.0.0"));
}
