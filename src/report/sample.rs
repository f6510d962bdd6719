//! A synthetic replay (status and audit rows) of any size, for the report's size test and
//! `examples/report_bench.rs`: two signatures (one drained, one whose canary came back),
//! replayed messages with some duplicates, failures and quarantined poison of a few reasons,
//! their decisions spread over time at 500 a second after a 5 s canary wait.

use chrono::{DateTime, Duration, Utc};

use crate::api::{AuditRef, CanaryResult, CanaryStatus, Counts, Phase, ReplayStatus};
use crate::engine::store::AuditRow;

use super::Meta;

const POISON: [&str; 3] = [
    "MaxDeathCount: died 4 times (maxDeathCount 3)",
    "MissingField: /asset_id",
    "InvalidJson: /chapters is not valid JSON",
];

fn at(t0: DateTime<Utc>, ms: i64) -> String {
    (t0 + Duration::milliseconds(ms)).to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// The manifest-side facts of the sample.
pub fn meta() -> Meta {
    Meta {
        namespace: "media".into(),
        name: "ep-fix-4411".into(),
        audit_key: "dlq:audit:media/ep-fix-4411/sample".into(),
        source_queue: Some("render.dlq".into()),
        mode: Some("Check".into()),
        target: Some("each message's original exchange and routing key".into()),
        rate: Some(500),
    }
}

/// A finished replay of `n` audited decisions (`n` ≥ 2), 8 held back besides.
pub fn replay(n: usize) -> (ReplayStatus, Vec<AuditRow>) {
    let t0 = DateTime::parse_from_rfc3339("2025-06-02T09:14:00.000Z")
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_default();
    let mut rows = Vec::with_capacity(n);
    let mut counts = Counts::default();
    const TIMEOUT: &str = "x-exception-type=TimeoutError";
    let row = |message: String, decision: &str, reason: &str, canary: bool, ms: i64| AuditRow {
        id: format!("{}-0", 1_748_855_640_000 + ms),
        replay: "sample".into(),
        message,
        decision: decision.into(),
        key: String::new(),
        reason: reason.into(),
        destination: String::new(),
        canary,
        time: at(t0, ms),
        signature: TIMEOUT.into(),
    };
    rows.push(row("job-000000".into(), "replayed", "", true, 120));
    rows.push(AuditRow {
        signature: "x-exception-type=KeyError".into(),
        ..row("job-k-0001".into(), "replayed", "", true, 125)
    });
    counts.replayed += 2;
    let drain = 5_300;
    for i in 2..n {
        let ms = drain + (i as i64 - 2) * 2;
        let id = format!("job-{i:06}");
        let (decision, reason) = match i % 50 {
            7 | 19 | 33 => ("duplicate", "key is done"),
            11 => ("quarantined", POISON[(i / 50) % POISON.len()]),
            41 if i % 150 == 41 => ("failed", "unroutable: no queue bound to render.work"),
            _ => ("replayed", ""),
        };
        match decision {
            "duplicate" => counts.duplicates += 1,
            "quarantined" => counts.quarantined += 1,
            "failed" => counts.failed += 1,
            _ => counts.replayed += 1,
        }
        rows.push(row(id, decision, reason, false, ms));
    }
    counts.skipped = 9;
    counts.returned = 1;
    counts.scanned =
        counts.replayed + counts.duplicates + counts.quarantined + counts.skipped + counts.failed;
    let selected = counts.replayed + counts.duplicates + counts.failed - 1;
    let last = drain + (n as i64) * 2;
    let status = ReplayStatus {
        phase: Some(Phase::Done),
        replay_id: Some("sample".into()),
        source_depth_at_start: Some(counts.scanned),
        counts,
        canary: vec![
            CanaryStatus {
                signature: TIMEOUT.into(),
                message_id: "job-000000".into(),
                sent_at: Some(at(t0, 120)),
                wait_until: Some(at(t0, 5_120)),
                result: CanaryResult::Passed,
                reason: None,
                messages: selected,
            },
            CanaryStatus {
                signature: "x-exception-type=KeyError".into(),
                message_id: "job-k-0001".into(),
                sent_at: Some(at(t0, 125)),
                wait_until: Some(at(t0, 5_125)),
                result: CanaryResult::DiedAgain,
                reason: Some("rejected (x-exception-type=KeyError)".into()),
                messages: 9,
            },
        ],
        audit: Some(AuditRef {
            key: "dlq:audit:media/ep-fix-4411/sample".into(),
            records: n as u64,
            ..AuditRef::default()
        }),
        started_at: Some(at(t0, 0)),
        finished_at: Some(at(t0, last + 40)),
        message: Some(format!(
            "{} replayed, {} held back (KeyError's canary came back)",
            counts.replayed, 8
        )),
        ..ReplayStatus::default()
    };
    (status, rows)
}
