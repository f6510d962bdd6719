//! `kubectl dlqreplay`: a replay in the cluster, by name, as kubectl does things.
//!
//! An executable named `kubectl-dlqreplay` on PATH is the plugin `kubectl dlqreplay` (krew
//! installs it from `deploy/krew/dlqreplay.yaml`). It talks to the cluster of the current
//! kubeconfig context, in its namespace or `-n`; it reads the replay's Redis (for `audit` and
//! `report`) through the URL its Secrets hold, as the operator does, or `--redis-url`. Errors go
//! to stderr as `error: ...`, with exit code 1; `-o yaml|json` print objects for scripts.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use kube::api::{Api, Patch, PatchParams};
use kube::Client;
use serde_json::json;

use crate::api::{DlqReplay, APPROVE_ANNOTATION, RETRY_ANNOTATION};
use crate::cli::AuditFormat;
use crate::engine::store;

/// Drive a DlqReplay in the cluster: see its plan and approve it, suspend, resume or retry it,
/// export its audit trail or write its incident report.
#[derive(Parser, Debug)]
#[command(name = "kubectl-dlqreplay", bin_name = "kubectl dlqreplay", version)]
pub struct Plugin {
    /// The replay's namespace (default: the kubeconfig context's).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    #[command(subcommand)]
    pub verb: Verb,
}

/// The verbs.
#[derive(Subcommand, Debug)]
pub enum Verb {
    /// Show the plan the operator made for approval (status.plan): counts per decision and per
    /// signature, and its digest.
    Plan {
        /// The DlqReplay.
        name: String,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t)]
        output: Format,
    },
    /// Approve the plan waiting for approval: set the annotation replay.dlq.dev/approve to its
    /// digest. With --digest, only when that is still the plan's (what you reviewed).
    Approve {
        /// The DlqReplay.
        name: String,
        /// The digest you reviewed; refused when the plan waiting is another.
        #[arg(long)]
        digest: Option<String>,
    },
    /// Pause the replay once its in-flight messages have settled (spec.suspend: true).
    Suspend {
        /// The DlqReplay.
        name: String,
    },
    /// Resume a suspended replay (spec.suspend: false).
    Resume {
        /// The DlqReplay.
        name: String,
    },
    /// Retry a Failed or CanaryFailed replay in place (annotation replay.dlq.dev/retry).
    Retry {
        /// The DlqReplay.
        name: String,
    },
    /// Export the replay's audit trail, one row per decision.
    Audit {
        /// The DlqReplay.
        name: String,
        /// Row format.
        #[arg(long, value_enum, default_value_t)]
        format: AuditFormat,
        /// The Redis that holds the trail (default: the URL the replay's Secret holds).
        #[arg(long, env = "REDIS_URL", hide_env_values = true)]
        redis_url: Option<String>,
    },
    /// Write the replay's incident report.
    Report {
        /// The DlqReplay.
        name: String,
        /// Page format.
        #[arg(long, value_enum, default_value_t)]
        format: crate::report::Format,
        /// Write to this file instead of standard output.
        #[arg(short = 'o', long)]
        output: Option<std::path::PathBuf>,
        /// The Redis that holds the trail (default: the URL the replay's Secret holds).
        #[arg(long, env = "REDIS_URL", hide_env_values = true)]
        redis_url: Option<String>,
    },
}

/// How `plan` prints.
#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum Format {
    /// A table, as `kubectl get`.
    #[default]
    Table,
    /// status.plan as YAML.
    Yaml,
    /// status.plan as JSON.
    Json,
}

/// Run a verb; exit 0 when it did what it says, 1 (the reason on stderr) otherwise.
pub async fn main(cli: Plugin) -> ExitCode {
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Plugin) -> Result<(), String> {
    let client = Client::try_default()
        .await
        .map_err(|e| format!("no cluster: {e}"))?;
    let ns = cli
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    let api: Api<DlqReplay> = Api::namespaced(client.clone(), &ns);
    match cli.verb {
        Verb::Plan { name, output } => plan(&api, &name, output).await,
        Verb::Approve { name, digest } => approve(&api, &name, digest.as_deref()).await,
        Verb::Suspend { name } => suspend(&api, &name, true).await,
        Verb::Resume { name } => suspend(&api, &name, false).await,
        Verb::Retry { name } => {
            let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
            annotate(&api, &name, RETRY_ANNOTATION, &now).await?;
            println!("dlqreplay.replay.dlq.dev/{name} retry asked ({RETRY_ANNOTATION}={now})");
            Ok(())
        }
        Verb::Audit {
            name,
            format,
            redis_url,
        } => {
            let (_, key, url) = trail(&client, &api, &name, redis_url).await?;
            let mut con = store::connect(&url).await.map_err(|e| e.to_string())?;
            let rows = store::read_audit(&mut con, &key)
                .await
                .map_err(|e| e.to_string())?;
            let mut out = std::io::stdout().lock();
            crate::cli::audit::write_audit(&mut out, &rows, format).map_err(|e| e.to_string())
        }
        Verb::Report {
            name,
            format,
            output,
            redis_url,
        } => report(&client, &api, &name, redis_url, format, output).await,
    }
}

async fn get(api: &Api<DlqReplay>, name: &str) -> Result<DlqReplay, String> {
    api.get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("dlqreplays.replay.dlq.dev {name:?} not found"))
}

async fn plan(api: &Api<DlqReplay>, name: &str, output: Format) -> Result<(), String> {
    let r = get(api, name).await?;
    let status = r.status.clone().unwrap_or_default();
    let Some(plan) = status.plan.clone() else {
        return Err(if r.spec.require_approval {
            format!(
                "{name}: no plan yet (the operator plans it first; phase {:?})",
                status.phase
            )
        } else {
            format!("{name}: spec.requireApproval is not set, so the operator makes no plan; `dlq-replay plan -f FILE` plans out of the cluster")
        });
    };
    match output {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(&plan).map_err(|e| e.to_string())?
        ),
        Format::Yaml => print!(
            "{}",
            serde_yaml::to_string(&plan).map_err(|e| e.to_string())?
        ),
        Format::Table => {
            let approved = status.approved_digest.as_deref() == Some(plan.digest.as_str());
            println!(
                "plan {} of {} ({} messages, planned {}){}",
                plan.digest,
                name,
                plan.depth,
                plan.planned_at,
                if approved { ", approved" } else { "" }
            );
            println!(
                "{:<48} {:>8} {:>10} {:>11} {:>8}",
                "SIGNATURE", "REPLAY", "DUPLICATE", "QUARANTINE", "SKIP"
            );
            let row = |s: &str, c: &crate::api::Counts| {
                println!(
                    "{:<48} {:>8} {:>10} {:>11} {:>8}",
                    s, c.replayed, c.duplicates, c.quarantined, c.skipped
                )
            };
            for (sig, c) in &plan.by_signature {
                row(sig, c);
            }
            row("TOTAL", &plan.counts);
        }
    }
    Ok(())
}

async fn approve(api: &Api<DlqReplay>, name: &str, reviewed: Option<&str>) -> Result<(), String> {
    let r = get(api, name).await?;
    let status = r.status.clone().unwrap_or_default();
    let Some(plan) = status.plan else {
        return Err(format!(
            "{name}: no plan waits for approval (spec.requireApproval: {})",
            r.spec.require_approval
        ));
    };
    if let Some(d) = reviewed.filter(|d| *d != plan.digest) {
        return Err(format!(
            "{name}: the plan waiting is {}, not {d}: the dead-letter queue changed since; review it (`kubectl dlqreplay plan {name}`)",
            plan.digest
        ));
    }
    if status.approved_digest.as_deref() == Some(plan.digest.as_str()) {
        println!(
            "dlqreplay.replay.dlq.dev/{name} plan {} already approved",
            plan.digest
        );
        return Ok(());
    }
    annotate(api, name, APPROVE_ANNOTATION, &plan.digest).await?;
    println!(
        "dlqreplay.replay.dlq.dev/{name} plan {} approved",
        plan.digest
    );
    Ok(())
}

async fn suspend(api: &Api<DlqReplay>, name: &str, on: bool) -> Result<(), String> {
    get(api, name).await?;
    let patch = json!({"spec": {"suspend": on}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| e.to_string())?;
    let what = if on { "suspended" } else { "resumed" };
    println!("dlqreplay.replay.dlq.dev/{name} {what}");
    Ok(())
}

async fn annotate(api: &Api<DlqReplay>, name: &str, key: &str, value: &str) -> Result<(), String> {
    get(api, name).await?;
    let patch = json!({"metadata": {"annotations": {key: value}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The replay, its audit key and the Redis that holds it (`--redis-url`, else its Secret's).
async fn trail(
    client: &Client,
    api: &Api<DlqReplay>,
    name: &str,
    redis_url: Option<String>,
) -> Result<(DlqReplay, String, String), String> {
    let r = get(api, name).await?;
    let url = match redis_url {
        Some(u) => u,
        None => crate::controller::resolve(client, &r).await?.redis_url,
    };
    let key = r
        .status
        .as_ref()
        .and_then(|s| s.audit.as_ref())
        .map(|a| a.key.clone())
        .ok_or_else(|| format!("{name}: no audit trail yet (it has not started)"))?;
    Ok((r, key, url))
}

async fn report(
    client: &Client,
    api: &Api<DlqReplay>,
    name: &str,
    redis_url: Option<String>,
    format: crate::report::Format,
    output: Option<std::path::PathBuf>,
) -> Result<(), String> {
    use crate::report;
    let (r, key, url) = trail(client, api, name, redis_url).await?;
    let meta = report::load::meta_of(&r);
    let (meta, status, rows) = report::load::load(&url, meta, Some(&key))
        .await
        .map_err(|e| e.to_string())?;
    report::write(meta, &status, &rows, format, output.as_deref())?;
    if let Some(path) = output {
        eprintln!("report of {name}: {}", path.display());
    }
    Ok(())
}
