use super::*;
use crate::api::{CanaryStatus, Phase};

fn row(message: &str, decision: &str, reason: &str, canary: bool, time: &str) -> AuditRow {
    AuditRow {
        replay: "r1".into(),
        message: message.into(),
        decision: decision.into(),
        reason: reason.into(),
        canary,
        time: time.into(),
        ..AuditRow::default()
    }
}

fn small() -> (ReplayStatus, Vec<AuditRow>) {
    let rows = vec![
        row("c-1", "replayed", "", true, "2025-01-01T10:00:00.100Z"),
        row("m-1", "replayed", "", false, "2025-01-01T10:00:05.200Z"),
        row(
            "m-2",
            "duplicate",
            "key is done",
            false,
            "2025-01-01T10:00:05.300Z",
        ),
        row(
            "<script>alert(1)</script>",
            "quarantined",
            "MissingField: /asset_id <b>",
            false,
            "2025-01-01T10:00:06.000Z",
        ),
    ];
    let status = ReplayStatus {
        phase: Some(Phase::Done),
        replay_id: Some("r1".into()),
        counts: Counts {
            scanned: 5,
            replayed: 2,
            duplicates: 1,
            quarantined: 1,
            skipped: 1,
            failed: 0,
            returned: 0,
        },
        canary: vec![CanaryStatus {
            signature: "x-exception-type=TimeoutError".into(),
            message_id: "c-1".into(),
            sent_at: Some("2025-01-01T10:00:00.100Z".into()),
            wait_until: Some("2025-01-01T10:00:05.100Z".into()),
            result: CanaryResult::Passed,
            reason: None,
            messages: 3,
        }],
        started_at: Some("2025-01-01T10:00:00.000Z".into()),
        finished_at: Some("2025-01-01T10:00:06.500Z".into()),
        message: Some("done".into()),
        ..ReplayStatus::default()
    };
    (status, rows)
}

fn meta() -> Meta {
    Meta {
        namespace: "media".into(),
        name: "ep-fix".into(),
        audit_key: "dlq:audit:media/ep-fix/r1".into(),
        source_queue: Some("demo.dlq".into()),
        mode: Some("Check".into()),
        ..Meta::default()
    }
}

#[test]
fn message_data_is_escaped_in_html_and_markdown() {
    let (status, rows) = small();
    let r = Report::build(meta(), &status, &rows);
    let page = html::render(&r);
    assert!(
        !page.contains("<script>"),
        "a message id got into the page as markup"
    );
    assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(page.contains("/asset_id &lt;b&gt;"));
    assert!(!page.contains("<script"), "no script at all in the page");
    let md = md::render(&r);
    assert!(!md.contains("<script>"));
    assert!(md.contains("&lt;script&gt;"));
}

#[test]
fn a_single_drained_signature_takes_the_drained_rows() {
    let (status, rows) = small();
    let r = Report::build(meta(), &status, &rows);
    assert_eq!(r.signatures.len(), 1);
    let g = &r.signatures[0];
    assert_eq!(
        (g.replayed, g.duplicates, g.failed, g.held_back, g.drained),
        (Some(2), Some(1), Some(0), 0, true)
    );
    assert_eq!(r.canaries[0].decision, "replayed");
    assert_eq!(r.rows_by_decision.get("quarantined"), Some(&1));
    // Timeline in time order: start, canary out, canary passed, draining, last, end.
    let kinds: Vec<&str> = r.timeline.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            "start",
            "canary-out",
            "canary-ok",
            "drain",
            "drain",
            "end-ok"
        ]
    );
}

#[test]
fn drained_rows_count_under_the_signature_they_name_and_a_failed_one_is_held_back() {
    let (status, rows) = sample::replay(100);
    let r = Report::build(sample::meta(), &status, &rows);
    let kinds: Vec<(bool, u64)> = r
        .signatures
        .iter()
        .map(|g| (g.drained, g.held_back))
        .collect();
    assert_eq!(kinds, [(true, 0), (false, 8)]);
    assert_eq!(r.signatures[1].replayed, Some(1), "its canary went out");
    let drained = |d: &str| {
        rows.iter()
            .filter(|row| !row.canary && row.decision == d)
            .count() as u64
    };
    // Both canaries passed: each signature gets the rows that name it, KeyError none.
    let mut two = status.clone();
    two.canary[1].result = CanaryResult::Passed;
    let r = Report::build(sample::meta(), &two, &rows);
    let counted: Vec<_> = r
        .signatures
        .iter()
        .map(|g| (g.replayed, g.duplicates, g.failed))
        .collect();
    assert_eq!(
        counted,
        [
            (
                Some(1 + drained("replayed")),
                Some(drained("duplicate")),
                Some(drained("failed"))
            ),
            (Some(1), Some(0), Some(0)),
        ]
    );
    // Rows of an older dlq-replay name no signature: with two drained they are not told apart.
    let unnamed: Vec<AuditRow> = rows
        .iter()
        .map(|row| AuditRow {
            signature: String::new(),
            ..row.clone()
        })
        .collect();
    let r = Report::build(sample::meta(), &two, &unnamed);
    assert!(r.signatures.iter().all(|g| g.replayed.is_none()));
    // With one drained they all go to it.
    let r = Report::build(sample::meta(), &status, &unnamed);
    assert_eq!(r.signatures[0].replayed, Some(1 + drained("replayed")));
}

#[test]
fn the_chart_buckets_the_rows_and_draws_a_line_of_real_points() {
    let (status, rows) = small();
    let r = Report::build(meta(), &status, &rows);
    // 5.9 s of rows: 0.1 s buckets, 60 of them; 4 rows in all.
    assert_eq!(r.rate.width, 0.1);
    assert_eq!(r.rate.counts.len(), 60);
    assert_eq!(r.rate.counts.iter().sum::<u64>(), 4);
    let svg = chart::svg(&r.rate, &[]);
    let points = svg
        .split("points=\"")
        .nth(1)
        .and_then(|p| p.split('"').next())
        .unwrap();
    assert_eq!(points.split(' ').count(), 120, "two points per bucket");
    assert!(points
        .split(' ')
        .all(|p| p.split(',').all(|v| v.parse::<f64>().is_ok())));
    assert_eq!(chart::sparkline(&r.rate).chars().count(), 60);
    assert_eq!(chart::nice(37.0), 50.0);
    assert_eq!(chart::nice(0.0), 1.0);
    assert_eq!(chart::nice(100.0), 100.0);
    // One row: one bucket, still a line.
    let one = chart::Series::of(&[time("2025-01-01T10:00:00Z").unwrap()]);
    assert_eq!(one.counts, [1]);
    assert!(chart::svg(&one, &[]).contains("<polyline"));
    assert!(chart::svg(&chart::Series::default(), &[]).contains("no audited decisions"));
}

#[test]
fn a_report_of_10k_messages_aggregates_and_stays_small() {
    let (status, rows) = sample::replay(10_000);
    let started = std::time::Instant::now();
    let r = Report::build(sample::meta(), &status, &rows);
    let page = html::render(&r);
    let md = md::render(&r);
    let took = started.elapsed();
    assert!(page.len() < 1_000_000, "{} bytes", page.len());
    assert!(page.len() < 100_000, "aggregated: {} bytes", page.len());
    assert!(md.len() < 100_000, "{} bytes", md.len());
    eprintln!(
        "10k rows: html {} bytes, md {} bytes, {} ms (debug build)",
        page.len(),
        md.len(),
        took.as_millis()
    );
    // Not every message: the canaries are listed, the quarantined only up to the cap.
    assert!(page.contains("job-000000") && page.contains("job-k-0001"));
    assert!(!page.contains("job-009999"));
    assert_eq!(r.quarantined.len(), QUARANTINE_LISTED);
    assert_eq!(
        r.quarantined.len() as u64 + r.quarantined_more,
        status.counts.quarantined
    );
    assert!(page.contains(&format!("and {} more quarantined", r.quarantined_more)));
    assert!(r.rate.counts.len() <= chart::MAX_BUCKETS);
    assert_eq!(r.audit_rows, 10_000);
}

#[test]
fn many_distinct_reasons_are_capped() {
    let rows: Vec<AuditRow> = (0..500)
        .map(|i| {
            row(
                &format!("m{i}"),
                "quarantined",
                &format!("InvalidJson: at {i}"),
                false,
                "2025-01-01T10:00:00Z",
            )
        })
        .collect();
    let r = Report::build(meta(), &ReplayStatus::default(), &rows);
    assert_eq!(r.reasons.len(), REASONS_LISTED);
    assert_eq!(r.reasons_more, (460, 460));
    assert!(html::render(&r).contains("and 460 more reasons (460 messages)"));
    assert!(r.phase.starts_with("not ended"));
}

#[test]
fn long_texts_are_cut() {
    let long = "x".repeat(1000);
    assert_eq!(cut(&long).chars().count(), TEXT_MAX + 1);
    assert_eq!(cut("short"), "short");
}

#[test]
fn an_audit_key_names_its_replay() {
    assert_eq!(
        load::names_of_key("dlq:audit:media/ep-fix-4411/4b1f"),
        Some(("media".into(), "ep-fix-4411".into()))
    );
    assert_eq!(load::names_of_key("dlq:audit:media/x"), None);
    assert_eq!(load::names_of_key("other"), None);
}

#[test]
fn markdown_has_the_same_sections() {
    let (status, rows) = sample::replay(300);
    let md = md::render(&Report::build(sample::meta(), &status, &rows));
    for section in [
        "## Timeline",
        "## Drain rate",
        "## By failure signature",
        "## Canaries",
        "## Decisions by reason",
        "## Quarantined messages",
    ] {
        assert!(md.contains(section), "{section}");
    }
    assert!(md.contains("x-exception-type=KeyError"));
    assert!(md.contains("**DiedAgain**"));
}
