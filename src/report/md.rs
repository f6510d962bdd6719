//! The report as Markdown: the same sections as the HTML page, the chart as a sparkline and a
//! short table of the busiest buckets. Text from messages is escaped for table cells ([`cell`]).

use std::fmt::Write;

use super::chart;
use super::{duration, offset, show_time, Report};

/// `s` made safe inside a Markdown table cell and inline text: `|`, backticks, `<`, `>`, `&`,
/// `*`, `_`, `[`, `]` and `\` are escaped; line breaks become spaces.
pub fn cell(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '|' | '`' | '*' | '_' | '[' | ']' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            '\n' | '\r' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

fn opt(v: Option<u64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "—".into())
}

/// The Markdown document.
pub fn render(r: &Report) -> String {
    let mut s = String::with_capacity(16 * 1024);
    let _ = writeln!(
        s,
        "# Replay {}/{}: {}\n",
        cell(&r.meta.namespace),
        cell(&r.meta.name),
        cell(&r.phase)
    );
    if !r.message.is_empty() {
        let _ = writeln!(s, "> {}\n", cell(&r.message));
    }
    if let Some(risk) = &r.risk {
        let _ = writeln!(s, "> **Redis eviction risk:** {}\n", cell(risk));
    }
    let unknown = || "—".to_string();
    let meta: [(&str, String); 10] = [
        (
            "Source DLQ",
            r.meta.source_queue.clone().unwrap_or_else(unknown),
        ),
        (
            "Idempotency mode",
            r.meta.mode.clone().unwrap_or_else(unknown),
        ),
        ("Target", r.meta.target.clone().unwrap_or_else(unknown)),
        (
            "Rate limit",
            r.meta
                .rate
                .map(|m| format!("{m} msg/s"))
                .unwrap_or_else(|| "none".into()),
        ),
        ("Started", show_time(r.started)),
        ("Ended", show_time(r.finished)),
        ("Duration", duration(r)),
        ("DLQ depth at start", opt(r.depth_at_start)),
        ("Replay id", r.replay_id.clone()),
        ("Audit key", r.meta.audit_key.clone()),
    ];
    s.push_str("| | |\n|---|---|\n");
    for (k, v) in meta {
        let _ = writeln!(s, "| {k} | {} |", cell(&v));
    }
    let c = r.counts;
    let _ = writeln!(
        s,
        "\n| scanned | replayed | duplicates | quarantined | held back / skipped | returned | failed |\n|---:|---:|---:|---:|---:|---:|---:|\n| {} | {} | {} | {} | {} | {} | {} |\n",
        c.scanned, c.replayed, c.duplicates, c.quarantined, c.skipped, c.returned, c.failed
    );

    s.push_str("## Timeline\n\n");
    for e in &r.timeline {
        let _ = writeln!(
            s,
            "- {} ({}): {}{}",
            show_time(e.at),
            offset(r, e.at),
            cell(&e.what),
            if e.detail.is_empty() {
                String::new()
            } else {
                format!(" — {}", cell(&e.detail))
            }
        );
    }

    s.push_str("\n## Drain rate\n\n");
    let (peak, at) = r.rate.peak();
    if r.rate.counts.is_empty() {
        s.push_str("No audited decisions.\n");
    } else {
        let _ = writeln!(
            s,
            "Audited decisions per second, {} buckets from the first decision (+0 s) to +{}; peak {}/s at +{}:\n\n```\n{}\n```\n",
            chart::fmt_secs(r.rate.width),
            chart::fmt_secs(r.rate.extent()),
            chart::fmt_num(peak),
            chart::fmt_secs(at),
            chart::sparkline(&r.rate)
        );
    }

    s.push_str("## By failure signature\n\n");
    s.push_str("| Signature | Selected | Canary | Outcome | Replayed | Duplicates | Failed | Held back |\n|---|---:|---|---|---:|---:|---:|---:|\n");
    for g in &r.signatures {
        let _ = writeln!(
            s,
            "| {} | {} | {} {} | {} | {} | {} | {} | {} |",
            cell(&g.signature),
            g.selected,
            cell(&g.canary_id),
            cell(&g.result),
            if g.drained { "drained" } else { "held back" },
            opt(g.replayed),
            opt(g.duplicates),
            opt(g.failed),
            g.held_back
        );
    }
    let _ = writeln!(
        s,
        "| **All messages** | {} | {} scanned, {} quarantined, {} skipped, {} returned | | {} | {} | {} | {} |\n",
        r.signatures.iter().map(|g| g.selected).sum::<u64>(),
        c.scanned,
        c.quarantined,
        c.skipped,
        c.returned,
        c.replayed,
        c.duplicates,
        c.failed,
        r.signatures.iter().map(|g| g.held_back).sum::<u64>()
    );

    s.push_str("## Canaries\n\n");
    if r.canaries.is_empty() {
        s.push_str("No canary was sent.\n\n");
    } else {
        s.push_str("| Signature | Message id | Sent | Wait until | Result | Why |\n|---|---|---|---|---|---|\n");
        for k in &r.canaries {
            let _ = writeln!(
                s,
                "| {} | {} | {} ({}) | {} ({}) | **{}** | {} |",
                cell(&k.signature),
                cell(&k.message_id),
                show_time(k.sent_at),
                offset(r, k.sent_at),
                show_time(k.wait_until),
                offset(r, k.wait_until),
                cell(&k.result),
                cell(&k.reason)
            );
        }
        s.push('\n');
    }

    s.push_str("## Decisions by reason\n\n");
    if r.reasons.is_empty() {
        s.push_str("No audited decision.\n");
    } else {
        s.push_str("| Decision | Reason | Messages | Examples |\n|---|---|---:|---|\n");
        for g in &r.reasons {
            let more = g.count.saturating_sub(g.examples.len() as u64);
            let ids: Vec<String> = g.examples.iter().map(|m| cell(m)).collect();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {}{} |",
                cell(&g.decision),
                if g.reason.is_empty() {
                    "—".to_string()
                } else {
                    cell(&g.reason)
                },
                g.count,
                ids.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            );
        }
        let (groups, rows) = r.reasons_more;
        if groups > 0 {
            let _ = writeln!(s, "\nand {groups} more reasons ({rows} messages).");
        }
    }
    if !r.quarantined.is_empty() {
        s.push_str("\n## Quarantined messages\n\n| Message id | Reason | When |\n|---|---|---|\n");
        for q in &r.quarantined {
            let _ = writeln!(
                s,
                "| {} | {} | {} |",
                cell(&q.message),
                cell(&q.reason),
                cell(&q.time)
            );
        }
        if r.quarantined_more > 0 {
            let _ = writeln!(
                s,
                "\nand {} more quarantined (`dlq-replay audit` lists every one).",
                r.quarantined_more
            );
        }
    }
    let _ = writeln!(
        s,
        "\n---\nMade by `dlq-replay report` from the audit stream `{}` ({} rows) and the stored status. Messages left in the DLQ (skipped, held back, returned) have no audit row: their numbers are the status's counts.",
        r.meta.audit_key.replace('`', "'"),
        r.audit_rows
    );
    s
}
