//! `dlq-replay report`: a readable incident report of one replay, built from its audit stream
//! and its stored status.
//!
//! [`Report::build`] turns (rows, status) into a model, aggregated so that its size does not grow
//! with the number of messages (counts per reason, per signature and per time bucket; message ids
//! only for the canaries and the first few per reason); [`html::render`] and [`md::render`] turn
//! the model into a page. All three are pure functions, so they are tested without Redis;
//! [`load`] reads the rows and the status from Redis for the command line.
//!
//! What the audit trail does not hold, the report does not invent: messages left in the DLQ
//! (skipped by the selector, held back, returned) have no audit row, so they appear as the
//! status's counts. Each row names its message's failure signature, so the drained rows are
//! counted per signature; rows written before rows named it are attributed to a signature only
//! when a single signature was drained.

pub mod chart;
pub mod html;
pub mod load;
pub mod md;
pub mod sample;

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};

use crate::api::{CanaryResult, Counts, ReplayStatus};
use crate::engine::store::AuditRow;

/// Message ids listed per reason (the rest is counted: "and K more").
pub const IDS_PER_REASON: usize = 5;
/// Quarantined messages listed one by one (the rest is counted).
pub const QUARANTINE_LISTED: usize = 20;
/// Reasons listed (the rest is summed into one line).
pub const REASONS_LISTED: usize = 40;
/// Longest text taken from a message (ids, reasons) before it is cut with "…".
pub const TEXT_MAX: usize = 160;

/// What the report says about the replay besides its rows and status (from the manifest, or
/// from the audit key alone).
#[derive(Debug, Clone, Default)]
pub struct Meta {
    /// The replay's namespace.
    pub namespace: String,
    /// The replay's name.
    pub name: String,
    /// The audit stream key.
    pub audit_key: String,
    /// spec.source.queue, when known.
    pub source_queue: Option<String>,
    /// Idempotency mode (Check, Claim, or none), when known.
    pub mode: Option<String>,
    /// Where replayed messages go, when known.
    pub target: Option<String>,
    /// spec.rate.messagesPerSecond, when known.
    pub rate: Option<u32>,
}

/// One point of the timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// When (None: not recorded; listed last).
    pub at: Option<DateTime<Utc>>,
    /// What, in a few words.
    pub what: String,
    /// More, e.g. a reason.
    pub detail: String,
    /// A CSS class / kind: start, canary-out, canary-ok, canary-bad, drain, end-ok, end-bad.
    pub kind: &'static str,
}

/// One failure signature's line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SignatureRow {
    /// The signature (e.g. `x-exception-type=TimeoutError`).
    pub signature: String,
    /// Messages of this signature selected for replay (status).
    pub selected: u64,
    /// The canary's message id, result and reason.
    pub canary_id: String,
    /// The canary's result.
    pub result: String,
    /// Drained, or held back.
    pub drained: bool,
    /// Replayed / duplicates / failed rows attributed to this signature (None: not attributable:
    /// rows that name no signature, with several signatures drained).
    pub replayed: Option<u64>,
    /// See `replayed`.
    pub duplicates: Option<u64>,
    /// See `replayed`.
    pub failed: Option<u64>,
    /// Left in the DLQ because the canary did not pass (selected minus the canary).
    pub held_back: u64,
}

/// One (decision, reason) group of audit rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReasonRow {
    /// replayed, duplicate, quarantined or failed.
    pub decision: String,
    /// The reason, cut to [`TEXT_MAX`].
    pub reason: String,
    /// Rows with it.
    pub count: u64,
    /// The first [`IDS_PER_REASON`] message ids.
    pub examples: Vec<String>,
}

/// One canary.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CanaryRow {
    /// Its signature.
    pub signature: String,
    /// Its message id.
    pub message_id: String,
    /// When it left.
    pub sent_at: Option<DateTime<Utc>>,
    /// Until when it was watched.
    pub wait_until: Option<DateTime<Utc>>,
    /// Passed, Confirmed, DiedAgain, Unconfirmed, Waiting.
    pub result: String,
    /// Whether the result lets its signature drain.
    pub ok: bool,
    /// Why it failed, if it did.
    pub reason: String,
    /// Its audit row's decision (replayed, failed), if found.
    pub decision: String,
}

/// One quarantined message listed by id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Listed {
    /// Message id.
    pub message: String,
    /// Reason.
    pub reason: String,
    /// When.
    pub time: String,
}

/// The report's model: everything a page shows, aggregated.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// From the manifest or the key.
    pub meta: Meta,
    /// The replay id.
    pub replay_id: String,
    /// The final phase, or a note that it has not ended.
    pub phase: String,
    /// Whether the phase is Done.
    pub ok: bool,
    /// The status's one-line summary.
    pub message: String,
    /// A risk the replay ran with (`status.redisEvictionRisk`).
    pub risk: Option<String>,
    /// When it started / ended.
    pub started: Option<DateTime<Utc>>,
    /// See `started`.
    pub finished: Option<DateTime<Utc>>,
    /// DLQ depth when it started.
    pub depth_at_start: Option<u64>,
    /// The status's counts.
    pub counts: Counts,
    /// Audit rows read.
    pub audit_rows: u64,
    /// Audit rows per decision (replayed, duplicate, quarantined, failed).
    pub rows_by_decision: BTreeMap<String, u64>,
    /// The timeline, in time order.
    pub timeline: Vec<Event>,
    /// Decisions per second over time.
    pub rate: chart::Series,
    /// Per failure signature.
    pub signatures: Vec<SignatureRow>,
    /// Per (decision, reason), most rows first, at most [`REASONS_LISTED`].
    pub reasons: Vec<ReasonRow>,
    /// Reasons not listed, and their rows.
    pub reasons_more: (u64, u64),
    /// The first [`QUARANTINE_LISTED`] quarantined messages.
    pub quarantined: Vec<Listed>,
    /// Quarantined messages not listed.
    pub quarantined_more: u64,
    /// The canaries.
    pub canaries: Vec<CanaryRow>,
    /// When the report was made.
    pub generated: Option<DateTime<Utc>>,
}

/// Parse an RFC 3339 time.
pub fn time(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// `s` cut to [`TEXT_MAX`] characters (with "…").
pub fn cut(s: &str) -> String {
    if s.chars().count() <= TEXT_MAX {
        return s.to_string();
    }
    let mut out: String = s.chars().take(TEXT_MAX).collect();
    out.push('…');
    out
}

fn result_name(r: CanaryResult) -> &'static str {
    match r {
        CanaryResult::Waiting => "Waiting",
        CanaryResult::Passed => "Passed",
        CanaryResult::Confirmed => "Confirmed",
        CanaryResult::DiedAgain => "DiedAgain",
        CanaryResult::Unconfirmed => "Unconfirmed",
    }
}

fn drains(r: CanaryResult) -> bool {
    matches!(r, CanaryResult::Passed | CanaryResult::Confirmed)
}

impl Report {
    /// The model of a replay's report from its status and audit rows (oldest first).
    pub fn build(meta: Meta, status: &ReplayStatus, rows: &[AuditRow]) -> Report {
        let phase = status.phase;
        let mut r = Report {
            meta,
            replay_id: status.replay_id.clone().unwrap_or_default(),
            phase: phase
                .map(|p| p.to_string())
                .unwrap_or_else(|| "not ended (running, stopped or failed)".into()),
            ok: phase == Some(crate::api::Phase::Done),
            message: status.message.clone().unwrap_or_default(),
            risk: status.redis_eviction_risk.clone(),
            started: status.started_at.as_deref().and_then(time),
            finished: status.finished_at.as_deref().and_then(time),
            depth_at_start: status.source_depth_at_start,
            counts: status.counts,
            audit_rows: rows.len() as u64,
            ..Report::default()
        };
        let times: Vec<DateTime<Utc>> = rows.iter().filter_map(|row| time(&row.time)).collect();
        r.rate = chart::Series::of(&times);
        r.canaries = canaries(status, rows);
        r.signatures = signatures(status, rows);
        r.aggregate(rows);
        r.timeline = timeline(&r, status, rows);
        r
    }

    fn aggregate(&mut self, rows: &[AuditRow]) {
        let mut groups: BTreeMap<(String, String), ReasonRow> = BTreeMap::new();
        for row in rows {
            *self
                .rows_by_decision
                .entry(row.decision.clone())
                .or_default() += 1;
            if row.decision == "quarantined" {
                if self.quarantined.len() < QUARANTINE_LISTED {
                    self.quarantined.push(Listed {
                        message: cut(&row.message),
                        reason: cut(&row.reason),
                        time: row.time.clone(),
                    });
                } else {
                    self.quarantined_more += 1;
                }
            }
            let reason = if row.reason.is_empty() && row.canary {
                "canary".to_string()
            } else {
                cut(&row.reason)
            };
            let g = groups
                .entry((row.decision.clone(), reason.clone()))
                .or_insert_with(|| ReasonRow {
                    decision: row.decision.clone(),
                    reason,
                    ..ReasonRow::default()
                });
            g.count += 1;
            if g.examples.len() < IDS_PER_REASON {
                g.examples.push(cut(&row.message));
            }
        }
        let mut all: Vec<ReasonRow> = groups.into_values().collect();
        all.sort_by(|a, b| {
            decision_rank(&a.decision)
                .cmp(&decision_rank(&b.decision))
                .then(b.count.cmp(&a.count))
                .then(a.reason.cmp(&b.reason))
        });
        if all.len() > REASONS_LISTED {
            let rest = all.split_off(REASONS_LISTED);
            self.reasons_more = (rest.len() as u64, rest.iter().map(|g| g.count).sum());
        }
        self.reasons = all;
    }

    /// When the first and the last audit row were written.
    pub fn span(&self) -> Option<(DateTime<Utc>, DateTime<Utc>)> {
        self.rate.span()
    }
}

fn decision_rank(d: &str) -> u8 {
    match d {
        "quarantined" => 0,
        "failed" => 1,
        "duplicate" => 2,
        "replayed" => 3,
        _ => 4,
    }
}

fn canaries(status: &ReplayStatus, rows: &[AuditRow]) -> Vec<CanaryRow> {
    status
        .canary
        .iter()
        .map(|c| {
            let row = rows
                .iter()
                .find(|row| row.canary && row.message == c.message_id);
            CanaryRow {
                signature: cut(&c.signature),
                message_id: cut(&c.message_id),
                sent_at: c.sent_at.as_deref().and_then(time),
                wait_until: c.wait_until.as_deref().and_then(time),
                result: result_name(c.result).into(),
                ok: drains(c.result),
                reason: cut(c.reason.as_deref().unwrap_or_default()),
                decision: row.map(|row| row.decision.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

fn signatures(status: &ReplayStatus, rows: &[AuditRow]) -> Vec<SignatureRow> {
    let drained = status.canary.iter().filter(|c| drains(c.result)).count();
    // The drained rows (not a canary's), per signature they name ("" for rows written before
    // rows named it: attributable only if a single signature drained).
    let mut rest: HashMap<&str, (u64, u64, u64)> = HashMap::new();
    for row in rows.iter().filter(|row| !row.canary) {
        let n = rest.entry(row.signature.as_str()).or_default();
        match row.decision.as_str() {
            "replayed" => n.0 += 1,
            "duplicate" => n.1 += 1,
            "failed" => n.2 += 1,
            _ => {}
        }
    }
    let unnamed = rest.get("").copied();
    status
        .canary
        .iter()
        .map(|c| {
            let own = rows
                .iter()
                .find(|row| row.canary && row.message == c.message_id);
            let own = |d: &str| u64::from(own.is_some_and(|row| row.decision == d));
            let ok = drains(c.result);
            let named = rest.get(c.signature.as_str()).copied().unwrap_or_default();
            let drained_rows = match unnamed {
                None => Some(named),
                Some(old) if drained == 1 => {
                    Some((named.0 + old.0, named.1 + old.1, named.2 + old.2))
                }
                Some(_) => None,
            };
            let (replayed, duplicates, failed) = if !ok {
                (Some(own("replayed")), Some(0), Some(own("failed")))
            } else if let Some(d) = drained_rows {
                (
                    Some(own("replayed") + d.0),
                    Some(d.1),
                    Some(own("failed") + d.2),
                )
            } else {
                (None, None, None)
            };
            SignatureRow {
                signature: cut(&c.signature),
                selected: c.messages,
                canary_id: cut(&c.message_id),
                result: result_name(c.result).into(),
                drained: ok,
                replayed,
                duplicates,
                failed,
                held_back: if ok { 0 } else { c.messages.saturating_sub(1) },
            }
        })
        .collect()
}

fn timeline(r: &Report, status: &ReplayStatus, rows: &[AuditRow]) -> Vec<Event> {
    let mut events = Vec::new();
    let ev = |at, what: String, detail: String, kind| Event {
        at,
        what,
        detail,
        kind,
    };
    events.push(ev(
        r.started,
        "Started".into(),
        r.depth_at_start
            .map(|d| format!("{d} messages in the DLQ"))
            .unwrap_or_default(),
        "start",
    ));
    let drain: Vec<DateTime<Utc>> = rows
        .iter()
        .filter(|row| !row.canary)
        .filter_map(|row| time(&row.time))
        .collect();
    let drain_first = drain.iter().min().copied();
    // Every verdict is in before the drain starts (or the replay ends): a verdict that came
    // before the wait's end (confirmed, came back) is shown by then.
    let decided_by = drain_first.or(r.finished);
    for c in &r.canaries {
        events.push(ev(
            c.sent_at,
            format!("Canary out: {}", c.signature),
            format!("message {}", c.message_id),
            "canary-out",
        ));
        let (what, detail) = match c.result.as_str() {
            "Passed" => ("not back: passed", "the wait ended".to_string()),
            "Confirmed" => ("confirmed: the worker marked its key done", String::new()),
            "DiedAgain" => ("came back: held back", c.reason.clone()),
            "Unconfirmed" => ("not confirmed done: held back", c.reason.clone()),
            _ => ("still watched", String::new()),
        };
        let at = match (c.wait_until, decided_by) {
            (Some(w), Some(d)) => Some(w.min(d)),
            (w, d) => w.or(d),
        };
        events.push(ev(
            at,
            format!("Canary {}: {what}", c.signature),
            detail,
            if c.ok { "canary-ok" } else { "canary-bad" },
        ));
    }
    if let (Some(first), Some(last)) = (drain.iter().min(), drain.iter().max()) {
        events.push(ev(
            Some(*first),
            "Draining".into(),
            format!("{} decisions audited", drain.len()),
            "drain",
        ));
        events.push(ev(
            Some(*last),
            "Last decision".into(),
            String::new(),
            "drain",
        ));
    }
    if let Some(p) = status.phase {
        events.push(ev(
            r.finished,
            format!("Ended {p}"),
            cut(&r.message),
            if r.ok { "end-ok" } else { "end-bad" },
        ));
    }
    // Stable: events without a time stay where they were relative to each other, after the rest.
    events.sort_by_key(|e| (e.at.is_none(), e.at));
    events
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// A self-contained HTML page (inline CSS and SVG).
    #[default]
    Html,
    /// Markdown.
    Md,
}

/// The report as a page in `format`.
pub fn render(report: &Report, format: Format) -> String {
    match format {
        Format::Html => html::render(report),
        Format::Md => md::render(report),
    }
}

/// The report of a replay dated now, rendered in `format` and written to `output` (standard
/// output when none): what `dlq-replay report` and `kubectl dlqreplay report` both do. Returns the
/// report (for what the caller says of it) and the page's length in bytes.
pub fn write(
    meta: Meta,
    status: &ReplayStatus,
    rows: &[AuditRow],
    format: Format,
    output: Option<&std::path::Path>,
) -> Result<(Report, usize), String> {
    let mut model = Report::build(meta, status, rows);
    model.generated = Some(Utc::now());
    let page = render(&model, format);
    match output {
        Some(path) => std::fs::write(path, &page).map_err(|e| format!("{}: {e}", path.display())),
        None => {
            use std::io::Write as _;
            std::io::stdout()
                .lock()
                .write_all(page.as_bytes())
                .map_err(|e| e.to_string())
        }
    }?;
    Ok((model, page.len()))
}

/// A time as `2025-01-31 12:00:05.123 UTC`, or "—".
pub fn show_time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string())
        .unwrap_or_else(|| "—".into())
}

/// A time of day as `12:00:05.123` (the date is in the report's header), or "—".
pub fn short_time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.format("%H:%M:%S%.3f").to_string())
        .unwrap_or_else(|| "—".into())
}

/// A time relative to the start of the replay, `+5.2 s`.
pub fn offset(report: &Report, t: Option<DateTime<Utc>>) -> String {
    let origin = report.started.or(report.span().map(|s| s.0));
    match (origin, t) {
        (Some(o), Some(t)) => {
            let ms = (t - o).num_milliseconds();
            format!(
                "{}{:.1} s",
                if ms < 0 { "−" } else { "+" },
                ms.abs() as f64 / 1000.0
            )
        }
        _ => String::new(),
    }
}

/// How long the replay took, when both ends are known.
pub fn duration(report: &Report) -> String {
    let end = report.finished.or(report.span().map(|s| s.1));
    match (report.started, end) {
        (Some(s), Some(e)) => {
            let secs = (e - s).num_milliseconds() as f64 / 1000.0;
            if secs < 120.0 {
                format!("{secs:.1} s")
            } else {
                format!("{:.1} min", secs / 60.0)
            }
        }
        _ => "—".into(),
    }
}

#[cfg(test)]
mod tests;
