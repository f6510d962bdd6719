//! How long `dlq-replay report` takes to build and render the report of a large replay, and how
//! big the page is: `cargo run --release --example report_bench` (REPORT_N rows, default 10,000;
//! REPORT_REPS runs, default 5; REPORT_OUT=path.html also writes the page). No broker or Redis:
//! the rows and status are synthetic (`dlq_replay::report::sample`), the work is the same
//! (Redis reading aside).

use std::time::Instant;

use dlq_replay::report::{self, sample, Format, Report};

fn main() {
    let n: usize = std::env::var("REPORT_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let reps: usize = std::env::var("REPORT_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
        .max(1);
    let (status, rows) = sample::replay(n.max(2));
    for format in [Format::Html, Format::Md] {
        let mut times = Vec::with_capacity(reps);
        let mut bytes = 0;
        for _ in 0..reps {
            let t = Instant::now();
            let model = Report::build(sample::meta(), &status, &rows);
            let page = report::render(&model, format);
            times.push(t.elapsed().as_secs_f64() * 1000.0);
            bytes = page.len();
            if format == Format::Html {
                if let Ok(path) = std::env::var("REPORT_OUT") {
                    if let Err(e) = std::fs::write(&path, &page) {
                        eprintln!("{path}: {e}");
                    }
                }
            }
        }
        times.sort_by(f64::total_cmp);
        println!(
            "report of {} audit rows, {:?}: median {:.2} ms, max {:.2} ms over {reps} runs; {bytes} bytes",
            rows.len(),
            format,
            times[times.len() / 2],
            times[times.len() - 1],
        );
    }
}
