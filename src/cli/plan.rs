//! `dlq-replay plan`: what a replay would do, and what its Redis pre-flight would find.

use std::process::ExitCode;

use super::{resolve, PlanArgs};
use crate::engine;
use crate::{manifest, Error};

pub(super) async fn plan(args: PlanArgs) -> Result<ExitCode, Error> {
    let resource = manifest::load(&args.file)?;
    let replay = resolve(&resource, &args.endpoints)?;
    let report = engine::plan::plan(&replay).await?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Error::Io(e.to_string()))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "queue {}: {} messages (dry run: nothing was changed)",
        replay.spec.source.queue, report.depth
    );
    println!(
        "{:<48} {:>8} {:>8} {:>10} {:>11} {:>8}",
        "SIGNATURE", "SCANNED", "REPLAY", "DUPLICATE", "QUARANTINE", "SKIP"
    );
    let row = |name: &str, c: &crate::api::Counts| {
        println!(
            "{:<48} {:>8} {:>8} {:>10} {:>11} {:>8}",
            name, c.scanned, c.replayed, c.duplicates, c.quarantined, c.skipped
        )
    };
    for (sig, c) in &report.by_signature {
        row(sig, c);
    }
    row("TOTAL", &report.counts);
    for (reason, n) in &report.reasons {
        println!("  {n:>6}  {reason}");
    }
    if !report.canaries.is_empty() {
        println!(
            "canaries: {} (one per signature, canary.waitSeconds {}):",
            report.canaries.len(),
            replay.spec.canary.wait_seconds
        );
        for (sig, id) in &report.canaries {
            println!("  {sig:<48} message {id}");
        }
    }
    println!(
        "{}",
        redis_line(&report, replay.spec.accepts_redis_eviction())
    );
    println!(
        "plan digest: {} (what an approval names: `dlq-replay run --approve DIGEST`, or the annotation replay.dlq.dev/approve with spec.requireApproval)",
        report.digest
    );
    if let Some(why) = &report.exceeds {
        println!("run would stop: {why}");
    }
    print_expect(report.expect.as_ref())?;
    Ok(ExitCode::SUCCESS)
}

/// The `spec.expect` stanza that approves what the plan saw, for the reviewer's pull request.
fn print_expect(expect: Option<&crate::api::ExpectSpec>) -> Result<(), Error> {
    let Some(expect) = expect else {
        println!("spec.expect: nothing would be replayed, so no stanza (an empty one would approve every signature)");
        return Ok(());
    };
    #[derive(serde::Serialize)]
    struct Stanza<'a> {
        expect: &'a crate::api::ExpectSpec,
    }
    let yaml = serde_yaml::to_string(&Stanza { expect }).map_err(|e| Error::Io(e.to_string()))?;
    println!("spec.expect that approves exactly this plan (paste it under `spec:` for review):");
    for line in yaml.lines() {
        println!("  {line}");
    }
    Ok(())
}

/// What `plan` says of the replay's Redis: what `run` would find there.
fn redis_line(report: &engine::plan::PlanReport, accepted: bool) -> String {
    let Some(c) = &report.redis else {
        let why = report.redis_error.as_deref().unwrap_or("unknown");
        return format!("redis: not checked ({why}); run refuses to start unless spec.audit.acceptRedisEviction");
    };
    let size = engine::store::human_bytes;
    let limit = match c.maxmemory {
        0 => "no maxmemory".to_string(),
        m => format!("maxmemory {}", size(m)),
    };
    let verdict = match (&c.risk, accepted) {
        (None, _) => "ok".to_string(),
        (Some(r), true) => format!("risk accepted (spec.audit.acceptRedisEviction): {r}"),
        (Some(r), false) => format!("run would refuse to start: {r}"),
    };
    format!(
        "redis: maxmemory-policy {}, {limit}, used {}; this replay writes up to {} at its peak: {verdict}",
        c.policy,
        size(c.used),
        size(c.expected)
    )
}
