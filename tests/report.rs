//! `dlq-replay report` of a real replay (canary, duplicates, poison) on the local RabbitMQ and
//! Redis, written by the real binary and opened in a real browser: headless Chromium dumps the
//! page's DOM (its text: name, numbers, canary id; the chart's polyline) and takes a screenshot
//! (the chart's area is painted).
//!
//! Chromium is Debian's `chromium` (`/usr/bin/chromium`, or `CHROMIUM=path`). Without it the
//! browser part prints SKIPPED, unless `REQUIRE_CHROMIUM=1` (CI, `.ci/run`), which fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dlq_replay::api::{CanaryResult, Phase};
use dlq_replay_testkit::world::*;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_dlq-replay");
const EVIL: &str = "<script>document.title='owned'</script>";

fn chromium() -> Option<PathBuf> {
    let candidates = [
        std::env::var("CHROMIUM").unwrap_or_default(),
        "/usr/bin/chromium".into(),
        "/usr/bin/chromium-browser".into(),
    ];
    candidates
        .into_iter()
        .filter(|c| !c.is_empty())
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// Run headless Chromium on `page` with `extra` arguments, a fresh profile, at most 90 s;
/// its stdout.
fn browse(chrome: &Path, page: &Path, profile: &Path, extra: &[&str]) -> String {
    let mut cmd = Command::new(chrome);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(format!("file://{}", page.display()))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start chromium");
    let stdout = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut { stdout }, &mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait chromium") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium {extra:?} did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = reader.join().unwrap_or_default();
    assert!(status.success(), "chromium {extra:?}: {status}");
    out
}

/// The text between `start` and the next `end` after it.
fn between<'a>(s: &'a str, start: &str, end: &str) -> &'a str {
    let i = s
        .find(start)
        .unwrap_or_else(|| panic!("{start:?} not in the page"));
    let rest = &s[i + start.len()..];
    &rest[..rest.find(end).unwrap_or(rest.len())]
}

/// Pixels of `png` within `tol` of `rgb`: their count and the width of the columns they span.
fn pixels_like(png_path: &Path, rgb: [u8; 3], tol: u8) -> (usize, usize, bool) {
    let file = std::fs::File::open(png_path).expect("screenshot");
    let decoder = png::Decoder::new(std::io::BufReader::new(file));
    let mut reader = decoder.read_info().expect("png header");
    let mut buf = vec![0; reader.output_buffer_size().expect("png size")];
    let info = reader.next_frame(&mut buf).expect("png frame");
    let channels = info.color_type.samples();
    assert!(channels >= 3, "{:?}", info.color_type);
    let (w, h) = (info.width as usize, info.height as usize);
    let (mut n, mut min_x, mut max_x) = (0, usize::MAX, 0);
    let first = &buf[..3];
    let mut uniform = true;
    for y in 0..h {
        for x in 0..w {
            let p = &buf[(y * w + x) * channels..][..3];
            uniform &= p == first;
            if p.iter().zip(rgb).all(|(a, b)| a.abs_diff(b) <= tol) {
                n += 1;
                min_x = min_x.min(x);
                max_x = max_x.max(x);
            }
        }
    }
    (n, if n > 0 { max_x - min_x + 1 } else { 0 }, uniform)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_replays_report_renders_in_a_real_browser() {
    let w = World::new("report").await;
    // 6 jobs of one signature, 2 of them already done (duplicates), 1 poison without /show
    // whose message id is markup.
    let mut jobs: Vec<_> = (0..6)
        .map(|i| job(&format!("r{i}"), json!({"show": "daily"})))
        .collect();
    jobs.push(job(EVIL, json!({})));
    w.dead_letter(jobs).await;
    w.set(&w.key("r4"), "done").await;
    w.set(&w.key("r5"), "done").await;
    let _worker = w.worker(|_| false).await;
    let spec = format!(
        "{}  poison: {{requiredFields: [/show]}}\n  canary: {{enabled: true, waitSeconds: 5}}\n",
        w.idempotency("Check")
    );
    let resource = w.manifest(&spec);
    let status = w.run(&resource).await;
    assert_eq!(status.phase, Some(Phase::Done), "{status:?}");
    let c = status.counts;
    assert_eq!(
        (c.replayed, c.duplicates, c.quarantined),
        (4, 2, 1),
        "{c:?}"
    );
    assert_eq!(status.canary.len(), 1);
    assert_eq!(status.canary[0].result, CanaryResult::Passed);
    let canary_id = status.canary[0].message_id.clone();

    // The real binary writes the report, from the manifest.
    let dir = tempfile::tempdir().expect("tempdir");
    let manifest = dir.path().join("replay.yaml");
    std::fs::write(&manifest, serde_yaml::to_string(&resource).unwrap()).unwrap();
    let page = dir.path().join("report.html");
    let out = Command::new(BIN)
        .args(["report", "-f"])
        .arg(&manifest)
        .arg("-o")
        .arg(&page)
        .args(["--redis-url", redis_url()])
        .output()
        .expect("dlq-replay report");
    assert!(out.status.success(), "{}", output_text(&out));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.len() < 1_000_000);
    assert!(
        !html.contains("<script"),
        "no script, and the message id is escaped"
    );
    assert!(!html.contains("src=\"http") && !html.contains("href=\"http"));
    // The Markdown form, by --key, to stdout.
    let key = &status.audit.as_ref().expect("audit ref").key;
    let md = Command::new(BIN)
        .args([
            "report",
            "--format",
            "md",
            "--key",
            key,
            "--redis-url",
            redis_url(),
        ])
        .output()
        .expect("dlq-replay report --format md");
    assert!(md.status.success(), "{}", output_text(&md));
    let md = String::from_utf8_lossy(&md.stdout);
    assert!(
        md.contains(&format!("# Replay tests/{}: Done", w.tag)),
        "{md}"
    );
    assert!(md.contains(&canary_id) && md.contains("x-exception-type=TimeoutError"));
    // `audit` finds the same trail from the manifest as from the key; a key without a Redis
    // URL is refused by name.
    let audit = |by: &[&std::ffi::OsStr]| {
        let out = Command::new(BIN)
            .args(["audit", "--format", "jsonl"])
            .args(by)
            .env_remove("REDIS_URL")
            .output()
            .expect("dlq-replay audit");
        (out.status.success(), output_text(&out), out.stdout)
    };
    let (ok, text, by_manifest) = audit(&[
        "-f".as_ref(),
        manifest.as_os_str(),
        "--redis-url".as_ref(),
        redis_url().as_ref(),
    ]);
    assert!(ok, "{text}");
    let (ok, text, by_key) = audit(&[
        "--key".as_ref(),
        key.as_ref(),
        "--redis-url".as_ref(),
        redis_url().as_ref(),
    ]);
    assert!(ok, "{text}");
    assert_eq!(
        String::from_utf8_lossy(&by_manifest).lines().count(),
        c.scanned as usize,
        "one row per decision"
    );
    assert_eq!(by_manifest, by_key);
    // Every row names its message's failure signature, the canary's included.
    for line in String::from_utf8_lossy(&by_manifest).lines() {
        let row: serde_json::Value = serde_json::from_str(line).expect("a JSON row");
        if row["decision"] != "quarantined" {
            assert_eq!(row["signature"], "x-exception-type=TimeoutError", "{line}");
        }
    }
    let (ok, text, _) = audit(&["--key".as_ref(), key.as_ref()]);
    assert!(
        !ok && text.contains("--key needs --redis-url or REDIS_URL"),
        "{text}"
    );

    let Some(chrome) = chromium() else {
        let msg =
            "chromium not found (/usr/bin/chromium; apt-get install -y chromium, or CHROMIUM=path)";
        if std::env::var("REQUIRE_CHROMIUM").as_deref() == Ok("1") {
            panic!("REQUIRE_CHROMIUM=1: {msg}");
        }
        eprintln!("SKIPPED the browser part: {msg}");
        w.cleanup().await;
        return;
    };
    let dom = browse(
        &chrome,
        &page,
        &dir.path().join("profile-dom"),
        &["--dump-dom"],
    );
    // What a reader sees: the name, the phase, the canary, the numbers per signature.
    assert!(dom.contains(&format!("Replay tests/{}", w.tag)), "{dom}");
    assert!(dom.contains(">Done<"));
    assert!(dom.contains(&w.topo.dlq), "the source DLQ");
    assert!(dom.contains(&canary_id));
    assert!(dom.contains("&lt;script&gt;document.title='owned'&lt;/script&gt;"));
    assert!(
        !dom.contains("<title>owned"),
        "the message id ran as a script"
    );
    let sig = between(&dom, "id=\"signatures\"", "</table>");
    let cells: Vec<&str> = sig
        .split("<td class=\"n\">")
        .skip(1)
        .map(|c| &c[..c.find('<').unwrap_or(0)])
        .collect();
    // Selected, replayed, duplicates, failed, held back.
    assert_eq!(cells, ["6", "4", "2", "0", "0"], "{sig}");
    assert!(sig.contains("x-exception-type=TimeoutError") && sig.contains("drained"));
    let totals = between(&dom, "id=\"totals\"", "</div></header>");
    for (n, label) in [
        (7, "scanned"),
        (4, "replayed"),
        (2, "duplicates"),
        (1, "quarantined"),
    ] {
        assert!(
            totals.contains(&format!("<b>{n}</b><span>{label}</span>")),
            "{label}: {totals}"
        );
    }
    let quarantined = between(&dom, "id=\"quarantined\"", "</table>");
    assert!(quarantined.contains("/show"), "{quarantined}");
    // The chart: a polyline of real points, some above the baseline.
    let points = between(&dom, "<polyline class=\"line\" points=\"", "\"");
    let ys: Vec<f64> = points
        .split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').expect("x,y");
            x.parse::<f64>().expect("x");
            y.parse::<f64>().expect("y")
        })
        .collect();
    assert!(ys.len() >= 2, "{points}");
    let base = ys.iter().copied().fold(f64::MIN, f64::max);
    assert!(ys.iter().any(|y| *y < base - 10.0), "a flat line: {points}");

    let shot = dir.path().join("report.png");
    browse(
        &chrome,
        &page,
        &dir.path().join("profile-shot"),
        &[
            "--window-size=1100,1600",
            &format!("--screenshot={}", shot.display()),
        ],
    );
    // The area under the line (#0969da at 15% on white) is painted, over some width.
    let (area, width, uniform) = pixels_like(&shot, [218, 232, 249], 6);
    assert!(!uniform, "a blank screenshot");
    assert!(
        area >= 300 && width >= 10,
        "chart area: {area} pixels over {width} columns"
    );
    let (line, _, _) = pixels_like(&shot, [9, 105, 218], 30);
    assert!(line >= 100, "chart line: {line} pixels");
    eprintln!("report in Chromium: chart area {area} px over {width} columns, line {line} px");
    w.cleanup().await;
}
