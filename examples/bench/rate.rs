//! The rate-accuracy section: rate-limited replays timed on the target queue.

use crate::broker::Section;
use crate::replay::Extras;
use crate::setup::Bench;

/// The rate-accuracy runs and their table.
pub(crate) async fn rate_section(b: &mut Bench) {
    // Rate accuracy.
    println!("\n== rate accuracy (arrival times on the target queue, from a consumer started before the replay)");
    let mut rows = Vec::new();
    for (count, limit) in [(5_000usize, 500u32), (1_000, 50)] {
        rows.push(b.rate(count, limit).await);
    }
    println!(
        "{:<8} {:>6} {:>14} {:>18} {:>16} {:>20} {:>11} {:>13}",
        "limit",
        "msgs",
        "achieved msg/s",
        "worst 1-s window",
        "first 1-s window",
        "worst after first 1s",
        "drain time",
        "process wall"
    );
    for row in rows {
        println!("{row}");
    }
    println!("  achieved = (arrivals - 1) / (last arrival - first arrival); a 1-s window is [t, t+1s) for every arrival t; the worst is the one with most arrivals (percent over the limit in brackets)");
}

impl Bench {
    /// One rate-limited replay; returns its row of the rate table.
    pub(crate) async fn rate(&mut self, count: usize, limit: u32) -> String {
        let (run, arrivals) = self
            .replay(
                &Section::classic_3_10(),
                &format!("rate{limit}"),
                count,
                "Check",
                Extras {
                    rate: Some(limit),
                    ..Default::default()
                },
            )
            .await;
        let label = format!("{limit}/s");
        if arrivals.len() < 2 {
            return format!("{label:<8} {count:>6} (no arrivals measured)");
        }
        let first = arrivals[0];
        let last = arrivals[arrivals.len() - 1];
        let achieved = (arrivals.len() - 1) as f64 / (last - first);
        let over = |w: usize| format!("{w} ({:+.1} %)", (w as f64 / limit as f64 - 1.0) * 100.0);
        let worst = worst_window(&arrivals, 1.0);
        let first_window = arrivals.iter().filter(|&&t| t < first + 1.0).count();
        let later: Vec<f64> = arrivals
            .iter()
            .copied()
            .filter(|&t| t >= first + 1.0)
            .collect();
        format!(
            "{label:<8} {:>6} {achieved:>14.1} {:>18} {first_window:>16} {:>20} {:>10.2}s {:>12.2}s",
            arrivals.len(),
            over(worst),
            over(worst_window(&later, 1.0)),
            last - first,
            run.wall
        )
    }
}

/// Most arrivals in any window `[t, t + width)` that starts at an arrival.
pub(crate) fn worst_window(times: &[f64], width: f64) -> usize {
    let mut best = 0;
    let mut j = 0;
    for i in 0..times.len() {
        while j < times.len() && times[j] < times[i] + width {
            j += 1;
        }
        best = best.max(j - i);
    }
    best
}
