//! The drain-rate chart: audit rows bucketed by time, drawn as an inline SVG (HTML) or a text
//! sparkline (Markdown).

use std::fmt::Write;

use chrono::{DateTime, Utc};

/// Bucket widths (seconds) to choose from: the first that gives at most [`MAX_BUCKETS`].
const WIDTHS: [f64; 19] = [
    0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0,
    3600.0, 7200.0, 21600.0, 86400.0,
];
/// The most buckets a chart has.
pub const MAX_BUCKETS: usize = 60;

/// Rows per time bucket.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// The first row's time (the chart's origin).
    pub start: Option<DateTime<Utc>>,
    /// The last row's time.
    pub end: Option<DateTime<Utc>>,
    /// Bucket width, seconds.
    pub width: f64,
    /// Rows per bucket.
    pub counts: Vec<u64>,
}

impl Series {
    /// Bucket `times` (any order).
    pub fn of(times: &[DateTime<Utc>]) -> Series {
        let (Some(start), Some(end)) = (times.iter().min(), times.iter().max()) else {
            return Series::default();
        };
        let span = (*end - *start).num_milliseconds().max(0) as f64 / 1000.0;
        let width = WIDTHS
            .iter()
            .copied()
            .find(|w| span / w < MAX_BUCKETS as f64)
            .unwrap_or(86400.0);
        let n = ((span / width).floor() as usize + 1).min(MAX_BUCKETS * 4);
        let mut counts = vec![0u64; n];
        for t in times {
            let at = (*t - *start).num_milliseconds().max(0) as f64 / 1000.0;
            let i = ((at / width).floor() as usize).min(n - 1);
            counts[i] += 1;
        }
        Series {
            start: Some(*start),
            end: Some(*end),
            width,
            counts,
        }
    }

    /// Rows per second in each bucket.
    pub fn rates(&self) -> Vec<f64> {
        self.counts
            .iter()
            .map(|c| *c as f64 / self.width.max(f64::MIN_POSITIVE))
            .collect()
    }

    /// The highest rate and the offset (s) of its bucket.
    pub fn peak(&self) -> (f64, f64) {
        self.rates()
            .iter()
            .enumerate()
            .fold((0.0, 0.0), |(best, at), (i, r)| {
                if *r > best {
                    (*r, i as f64 * self.width)
                } else {
                    (best, at)
                }
            })
    }

    /// The first and last row's times.
    pub fn span(&self) -> Option<(DateTime<Utc>, DateTime<Utc>)> {
        Some((self.start?, self.end?))
    }

    /// Seconds the buckets cover.
    pub fn extent(&self) -> f64 {
        self.counts.len() as f64 * self.width
    }
}

/// A "nice" axis maximum ≥ `v` (1, 2, 2.5, 5 × 10^k).
pub fn nice(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * p)
}

fn num(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        let s = if v.abs() < 10.0 {
            format!("{v:.2}")
        } else {
            format!("{v:.1}")
        };
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn secs(v: f64) -> String {
    if v >= 120.0 {
        format!("{} min", num(v / 60.0))
    } else {
        format!("{} s", num(v))
    }
}

const W: f64 = 760.0;
const H: f64 = 240.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 14.0;
const BOTTOM: f64 = 40.0;

/// A vertical marker on the chart: offset from the series' start (s) and a label.
#[derive(Debug, Clone, PartialEq)]
pub struct Marker {
    /// Seconds after the series' start.
    pub at: f64,
    /// Short label (escaped by [`svg`]).
    pub label: String,
}

/// The series as an inline SVG: a step line of decisions per second (a `<polyline>` with one
/// point per bucket edge), the area under it, axes with labels, and `markers`.
pub fn svg(series: &Series, markers: &[Marker]) -> String {
    let mut s = String::with_capacity(4096);
    let _ = write!(
        s,
        r##"<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="Audited decisions per second over time">"##
    );
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let rates = series.rates();
    let ymax = nice(rates.iter().copied().fold(0.0, f64::max));
    let extent = series.extent().max(f64::MIN_POSITIVE);
    let x = |t: f64| LEFT + t / extent * pw;
    let y = |r: f64| TOP + ph - r / ymax * ph;
    // Grid and y labels.
    for i in 0..=4 {
        let v = ymax * i as f64 / 4.0;
        let yy = y(v);
        let _ = write!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" class="grid"/><text x="{:.1}" y="{:.1}" class="ylabel" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            yy + 4.0,
            num(v)
        );
    }
    let _ = write!(
        s,
        r##"<text x="14" y="{:.1}" class="axis-title" transform="rotate(-90 14 {:.1})" text-anchor="middle">decisions / s</text>"##,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    // X labels: 0, ¼, ½, ¾, end.
    for i in 0..=4 {
        let t = extent * i as f64 / 4.0;
        let anchor = match i {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        let _ = write!(
            s,
            r##"<text x="{:.1}" y="{:.1}" class="xlabel" text-anchor="{anchor}">+{}</text>"##,
            x(t),
            TOP + ph + 16.0,
            secs(t)
        );
    }
    let _ = write!(
        s,
        r##"<text x="{:.1}" y="{:.1}" class="axis-title" text-anchor="middle">time since the first decision ({} buckets)</text>"##,
        LEFT + pw / 2.0,
        H - 4.0,
        secs(series.width)
    );
    let _ = write!(
        s,
        r##"<line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" class="axis"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" class="axis"/>"##,
        TOP + ph,
        LEFT + pw,
        TOP + ph,
        TOP + ph
    );
    for m in markers.iter().filter(|m| m.at >= 0.0 && m.at <= extent) {
        let xx = x(m.at);
        let _ = write!(
            s,
            r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" class="marker"/><text x="{:.1}" y="{:.1}" class="mlabel">{}</text>"##,
            TOP + ph,
            xx + 3.0,
            TOP + 10.0,
            esc(&m.label)
        );
    }
    if rates.is_empty() {
        let _ = write!(
            s,
            r##"<text x="{:.1}" y="{:.1}" class="empty" text-anchor="middle">no audited decisions</text></svg>"##,
            LEFT + pw / 2.0,
            TOP + ph / 2.0
        );
        return s;
    }
    let mut points = String::with_capacity(rates.len() * 24);
    for (i, r) in rates.iter().enumerate() {
        let (x0, x1, yy) = (
            x(i as f64 * series.width),
            x((i + 1) as f64 * series.width),
            y(*r),
        );
        let _ = write!(points, "{x0:.1},{yy:.1} {x1:.1},{yy:.1} ");
    }
    let points = points.trim_end();
    let _ = write!(
        s,
        r##"<path class="area" d="M{LEFT:.1},{:.1} L{} L{:.1},{:.1} Z"/><polyline class="line" points="{points}"/></svg>"##,
        TOP + ph,
        points.replace(' ', " L"),
        x(extent),
        TOP + ph
    );
    s
}

/// The series as a text sparkline (one character per bucket, at most [`MAX_BUCKETS`]).
pub fn sparkline(series: &Series) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let rates = series.rates();
    let max = rates.iter().copied().fold(0.0, f64::max);
    rates
        .iter()
        .take(MAX_BUCKETS)
        .map(|r| {
            if *r <= 0.0 || max <= 0.0 {
                ' '
            } else {
                BARS[((r / max) * 7.0).round().clamp(0.0, 7.0) as usize]
            }
        })
        .collect()
}

/// Offsets and labels formatted for text.
pub fn fmt_secs(v: f64) -> String {
    secs(v)
}

/// A number without a trailing `.0`.
pub fn fmt_num(v: f64) -> String {
    num(v)
}

/// `s` escaped for HTML and SVG text and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}
