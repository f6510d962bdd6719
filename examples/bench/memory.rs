//! The memory-growth section.

use crate::broker::Section;
use crate::costs::rss_text;
use crate::replay::Extras;
use crate::setup::Bench;

/// The memory-growth runs (10,000 and, unless BENCH_MEM=0, 100,000 messages).
pub(crate) async fn memory_section(b: &mut Bench, mem: bool) {
    // Memory growth.
    println!("\n== memory growth (Check mode, same setup as the throughput runs)");
    let base = Section::classic_3_10();
    let small = b
        .replay(&base, "mem10k", 10_000, "Check", Extras::default())
        .await
        .0;
    let big = if mem {
        Some(
            b.replay(&base, "mem100k", 100_000, "Check", Extras::default())
                .await
                .0,
        )
    } else {
        println!("  N = 100000 skipped (BENCH_MEM=0)");
        None
    };
    println!(
        "{:<10} {:>14} {:>12} {:>10}",
        "N", "peak RSS", "wall", "msg/s"
    );
    for r in std::iter::once(&small).chain(big.as_ref()) {
        println!(
            "{:<10} {:>14} {:>11.2}s {:>10.0}",
            r.n,
            rss_text(r.rss_kib),
            r.wall,
            r.rate()
        );
    }
    if let (Some(big), Some(a), Some(z)) =
        (&big, small.rss_kib, big.as_ref().and_then(|r| r.rss_kib))
    {
        println!(
            "  ratio 100k/10k: {:.2}x peak RSS for {}x messages ({:.1} KiB per extra message)",
            z as f64 / a as f64,
            big.n / small.n,
            (z as f64 - a as f64) / (big.n - small.n) as f64
        );
    }
}
