//! The report as one self-contained HTML page: inline CSS and SVG, no script, no external
//! resource. Everything that comes from messages or the status is escaped ([`chart::esc`]).

use std::fmt::Write;

use super::chart::{self, esc, Marker};
use super::{duration, offset, short_time, show_time, Report};

const CSS: &str = r#"
:root{--fg:#1f2328;--muted:#59636e;--line:#d1d9e0;--bg:#f6f8fa;--ok:#1a7f37;--bad:#cf222e;--warn:#9a6700;--accent:#0969da}
*{box-sizing:border-box}
body{margin:0;background:#fff;color:var(--fg);font:15px/1.45 -apple-system,"Segoe UI","Noto Sans","DejaVu Sans",Helvetica,Arial,sans-serif}
main{max-width:1040px;margin:0 auto;padding:28px 32px 40px}
h1{font-size:26px;margin:0 0 4px}
h2{font-size:18px;margin:30px 0 10px;padding-bottom:6px;border-bottom:1px solid var(--line)}
.sub{color:var(--muted);margin:0 0 16px;word-break:break-all}
.warn{color:#b45309;font-weight:600}
code,.mono{font-family:"DejaVu Sans Mono",ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
.badge{display:inline-block;padding:2px 10px;border-radius:12px;font-size:14px;font-weight:600;vertical-align:middle;margin-left:8px;color:#fff;background:var(--bad)}
.badge.ok{background:var(--ok);color:#fff}
.meta{display:grid;grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:6px 20px;background:var(--bg);border:1px solid var(--line);border-radius:8px;padding:12px 16px;margin:0}
.meta div{min-width:0}.meta dt{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}.meta dd{margin:0;word-break:break-all}
.totals{display:flex;flex-wrap:wrap;gap:10px;margin-top:14px}
.card{flex:1 1 110px;border:1px solid var(--line);border-radius:8px;padding:10px 12px}
.card b{display:block;font-size:24px;line-height:1.2}.card span{color:var(--muted);font-size:13px}
.card.ok b{color:var(--ok)}.card.bad b{color:var(--bad)}.card.warn b{color:var(--warn)}
table{border-collapse:collapse;width:100%;font-size:14px}
th{font-size:13px}
tfoot th{white-space:normal}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid var(--line);vertical-align:top}
th{background:var(--bg);font-weight:600;white-space:nowrap}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td{overflow-wrap:break-word}
td code{overflow-wrap:anywhere}
td.k{white-space:nowrap}
.scroll{overflow-x:auto}
#signatures td:first-child,#canaries td:first-child{min-width:240px}
.ok{color:var(--ok)}.bad{color:var(--bad)}.muted{color:var(--muted)}
ol.timeline{list-style:none;margin:0;padding:0 0 0 6px;border-left:3px solid var(--line)}
ol.timeline li{position:relative;padding:4px 0 8px 18px}
ol.timeline li::before{content:"";position:absolute;left:-9.5px;top:9px;width:12px;height:12px;border-radius:50%;background:var(--muted);border:2px solid #fff}
ol.timeline li.start::before,ol.timeline li.drain::before{background:var(--accent)}
ol.timeline li.canary-out::before{background:var(--warn)}
ol.timeline li.canary-ok::before,ol.timeline li.end-ok::before{background:var(--ok)}
ol.timeline li.canary-bad::before,ol.timeline li.end-bad::before{background:var(--bad)}
.when{color:var(--muted);font-size:13px;font-variant-numeric:tabular-nums}
.chart{display:block;width:100%;height:auto;border:1px solid var(--line);border-radius:8px;background:#fff}
.chart .grid{stroke:#eaeef2;stroke-width:1}.chart .axis{stroke:#8c959f;stroke-width:1}
.chart text{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;font-size:11px;fill:#59636e}
.chart .axis-title{font-size:12px;fill:#1f2328}
.chart .line{fill:none;stroke:#0969da;stroke-width:2;stroke-linejoin:round}
.chart .area{fill:#0969da;fill-opacity:.15;stroke:none}
.chart .marker{stroke:#9a6700;stroke-width:1;stroke-dasharray:4 3}.chart .mlabel{fill:#9a6700}
.note{color:var(--muted);font-size:13px;margin:6px 0 0}
footer{margin-top:34px;color:var(--muted);font-size:12px}
@media print{main{padding:0}}
"#;

fn opt_num(v: Option<u64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "—".into())
}

/// The page.
pub fn render(r: &Report) -> String {
    let mut s = String::with_capacity(32 * 1024);
    let title = format!("Replay {}/{}", r.meta.namespace, r.meta.name);
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{} — dlq-replay report</title><style>{CSS}</style></head><body><main>\n",
        esc(&title)
    );
    header(&mut s, r, &title);
    timeline(&mut s, r);
    rate(&mut s, r);
    signatures(&mut s, r);
    canaries(&mut s, r);
    reasons(&mut s, r);
    quarantined(&mut s, r);
    let _ = write!(
        s,
        "<footer>Made by <code>dlq-replay report</code> from the audit stream <code>{}</code> ({} rows) and the replay's stored status{}. Messages left in the DLQ (skipped, held back, returned) have no audit row: their numbers are the status's counts.</footer>\n</main></body></html>\n",
        esc(&r.meta.audit_key),
        r.audit_rows,
        r.generated
            .map(|t| format!(", {}", show_time(Some(t))))
            .unwrap_or_default()
    );
    s
}

fn header(s: &mut String, r: &Report, title: &str) {
    let _ = write!(
        s,
        "<header><h1>{}<span class=\"badge{}\" id=\"phase\">{}</span></h1><p class=\"sub\">{}</p>",
        esc(title),
        if r.ok { " ok" } else { "" },
        esc(&r.phase),
        esc(&r.message)
    );
    if let Some(risk) = &r.risk {
        let _ = write!(
            s,
            "<p class=\"sub warn\" id=\"risk\">Redis eviction risk: {}</p>",
            esc(risk)
        );
    }
    let unknown = || "—".to_string();
    let items: [(&str, String); 10] = [
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
        ("DLQ depth at start", opt_num(r.depth_at_start)),
        ("Replay id", r.replay_id.clone()),
        ("Audit key", r.meta.audit_key.clone()),
    ];
    s.push_str("<dl class=\"meta\">");
    for (k, v) in items {
        let _ = write!(s, "<div><dt>{k}</dt><dd>{}</dd></div>", esc(&v));
    }
    s.push_str("</dl>");
    let c = r.counts;
    let cards: [(&str, u64, &str); 7] = [
        ("scanned", c.scanned, ""),
        ("replayed", c.replayed, "ok"),
        ("duplicates", c.duplicates, ""),
        (
            "quarantined",
            c.quarantined,
            if c.quarantined > 0 { "warn" } else { "" },
        ),
        ("held back / skipped", c.skipped, ""),
        (
            "returned",
            c.returned,
            if c.returned > 0 { "bad" } else { "" },
        ),
        ("failed", c.failed, if c.failed > 0 { "bad" } else { "" }),
    ];
    s.push_str("<div class=\"totals\" id=\"totals\">");
    for (label, n, class) in cards {
        let _ = write!(
            s,
            "<div class=\"card {class}\"><b>{n}</b><span>{label}</span></div>"
        );
    }
    s.push_str("</div></header>\n");
}

fn timeline(s: &mut String, r: &Report) {
    s.push_str("<section><h2>Timeline</h2><ol class=\"timeline\" id=\"timeline\">");
    for e in &r.timeline {
        let _ = write!(
            s,
            "<li class=\"{}\"><span class=\"when\">{} <b>{}</b></span><br>{}{}</li>",
            e.kind,
            esc(&short_time(e.at)),
            esc(&offset(r, e.at)),
            esc(&e.what),
            if e.detail.is_empty() {
                String::new()
            } else {
                format!(" <span class=\"muted\">— {}</span>", esc(&e.detail))
            }
        );
    }
    s.push_str("</ol></section>\n");
}

fn rate(s: &mut String, r: &Report) {
    s.push_str("<section><h2>Drain rate</h2>");
    let mut markers = Vec::new();
    if let Some(start) = r.rate.start {
        for e in r.timeline.iter().filter(|e| e.kind == "drain") {
            if let Some(at) = e.at {
                if e.what == "Draining" {
                    markers.push(Marker {
                        at: (at - start).num_milliseconds() as f64 / 1000.0,
                        label: "drain starts".into(),
                    });
                }
            }
        }
    }
    s.push_str(&chart::svg(&r.rate, &markers));
    let (peak, at) = r.rate.peak();
    let _ = writeln!(
        s,
        "<p class=\"note\">Audited decisions per second (replayed, duplicate, quarantined, failed; {} buckets). Peak {}/s at +{}{}.</p></section>",
        chart::fmt_secs(r.rate.width),
        chart::fmt_num(peak),
        chart::fmt_secs(at),
        r.meta
            .rate
            .map(|m| format!("; the rate limit is {m}/s for publishes"))
            .unwrap_or_default()
    );
}

fn signatures(s: &mut String, r: &Report) {
    s.push_str("<section><h2>By failure signature</h2>");
    let c = r.counts;
    s.push_str("<div class=\"scroll\"><table id=\"signatures\"><thead><tr><th>Signature</th><th class=\"n\">Selected</th><th>Canary → outcome</th><th class=\"n\">Replayed</th><th class=\"n\">Duplicates</th><th class=\"n\">Failed</th><th class=\"n\">Held back</th></tr></thead><tbody>");
    for g in &r.signatures {
        let _ = write!(
            s,
            "<tr><td><code>{}</code></td><td class=\"n\">{}</td><td><code>{}</code> <span class=\"{}\">{}</span> → <b class=\"{}\">{}</b></td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(&g.signature),
            g.selected,
            esc(&g.canary_id),
            if g.drained { "ok" } else { "bad" },
            esc(&g.result),
            if g.drained { "ok" } else { "bad" },
            if g.drained { "drained" } else { "held back" },
            opt_num(g.replayed),
            opt_num(g.duplicates),
            opt_num(g.failed),
            g.held_back
        );
    }
    let _ = write!(
        s,
        "</tbody><tfoot><tr><th>All messages</th><th class=\"n\">{}</th><th>{} scanned · {} quarantined · {} skipped · {} returned</th><th class=\"n\">{}</th><th class=\"n\">{}</th><th class=\"n\">{}</th><th class=\"n\">{}</th></tr></tfoot></table></div>",
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
    if r.signatures.is_empty() {
        s.push_str("<p class=\"note\">No canary ran (canary disabled, or the replay stopped before it), so no signature was told apart; the totals are the replay's.</p>");
    } else {
        s.push_str("<p class=\"note\">Selected: messages of the signature chosen for replay (poison is quarantined before). Drained rows are counted by the signature their audit row names (—: rows of an older dlq-replay, which did not name it, with several signatures drained).</p>");
    }
    s.push_str("</section>\n");
}

fn canaries(s: &mut String, r: &Report) {
    s.push_str("<section><h2>Canaries</h2>");
    if r.canaries.is_empty() {
        s.push_str("<p class=\"muted\">No canary was sent.</p></section>\n");
        return;
    }
    s.push_str("<div class=\"scroll\"><table id=\"canaries\"><thead><tr><th>Signature</th><th>Message id</th><th>Sent</th><th>Wait until</th><th>Result</th><th>Why</th></tr></thead><tbody>");
    for c in &r.canaries {
        let _ = write!(
            s,
            "<tr><td><code>{}</code></td><td><code>{}</code></td><td class=\"when k\">{} <b>{}</b></td><td class=\"when k\">{} <b>{}</b></td><td class=\"k {}\"><b>{}</b></td><td>{}</td></tr>",
            esc(&c.signature),
            esc(&c.message_id),
            esc(&short_time(c.sent_at)),
            esc(&offset(r, c.sent_at)),
            esc(&short_time(c.wait_until)),
            esc(&offset(r, c.wait_until)),
            if c.ok { "ok" } else { "bad" },
            esc(&c.result),
            esc(&c.reason)
        );
    }
    s.push_str("</tbody></table></div></section>\n");
}

fn reasons(s: &mut String, r: &Report) {
    s.push_str("<section><h2>Decisions by reason</h2>");
    if r.reasons.is_empty() {
        s.push_str("<p class=\"muted\">No audited decision.</p></section>\n");
        return;
    }
    s.push_str("<div class=\"scroll\"><table id=\"reasons\"><thead><tr><th>Decision</th><th>Reason</th><th class=\"n\">Messages</th><th>Examples</th></tr></thead><tbody>");
    for g in &r.reasons {
        let more = g.count.saturating_sub(g.examples.len() as u64);
        let ids: Vec<String> = g
            .examples
            .iter()
            .map(|m| format!("<code>{}</code>", esc(m)))
            .collect();
        let _ = write!(
            s,
            "<tr><td class=\"k\">{}</td><td>{}</td><td class=\"n\">{}</td><td>{}{}</td></tr>",
            esc(&g.decision),
            if g.reason.is_empty() {
                "<span class=\"muted\">—</span>".to_string()
            } else {
                esc(&g.reason)
            },
            g.count,
            ids.join(", "),
            if more > 0 {
                format!(" <span class=\"muted\">and {more} more</span>")
            } else {
                String::new()
            }
        );
    }
    s.push_str("</tbody></table></div>");
    let (groups, rows) = r.reasons_more;
    if groups > 0 {
        let _ = write!(
            s,
            "<p class=\"note\">and {groups} more reasons ({rows} messages).</p>"
        );
    }
    s.push_str("</section>\n");
}

fn quarantined(s: &mut String, r: &Report) {
    if r.quarantined.is_empty() {
        return;
    }
    s.push_str("<section><h2>Quarantined messages</h2><div class=\"scroll\"><table id=\"quarantined\"><thead><tr><th>Message id</th><th>Reason</th><th>When</th></tr></thead><tbody>");
    for q in &r.quarantined {
        let _ = write!(
            s,
            "<tr><td><code>{}</code></td><td>{}</td><td class=\"when\">{}</td></tr>",
            esc(&q.message),
            esc(&q.reason),
            esc(&q.time)
        );
    }
    s.push_str("</tbody></table></div>");
    if r.quarantined_more > 0 {
        let _ = write!(
            s,
            "<p class=\"note\">and {} more quarantined (<code>dlq-replay audit</code> lists every one).</p>",
            r.quarantined_more
        );
    }
    s.push_str("</section>\n");
}
