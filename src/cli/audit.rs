//! `dlq-replay audit` and `report`: a replay's audit trail, from Redis or from its log lines.

use std::process::ExitCode;

use super::{resolve, AuditArgs, AuditFormat, Endpoints, ReportArgs, TrailArgs};
use crate::api::DlqReplay;
use crate::engine::{store, Replay};
use crate::{manifest, Error};

/// What `audit` and `report` read: a manifest (`-f`) and the replay it resolves to, or an audit
/// key (`--key`).
enum AuditSource {
    Manifest(Box<(DlqReplay, Replay)>),
    Key(String),
}

/// Where `audit` and `report` read, and the Redis that holds it: the manifest's (`-f`), else
/// `--redis-url` / `REDIS_URL` (`--key` alone).
fn audit_source(trail: &TrailArgs) -> Result<(String, AuditSource), Error> {
    let endpoints = &trail.endpoints;
    match (trail.file.as_deref(), trail.key.as_deref()) {
        (Some(f), _) => {
            let resource = manifest::load(f)?;
            // The broker is not contacted: any URL satisfies the manifest's broker check.
            let endpoints = Endpoints {
                amqp_url: Some("amqp://unused".into()),
                ..endpoints.clone()
            };
            let replay = resolve(&resource, &endpoints)?;
            let url = replay.redis_url.clone();
            Ok((url, AuditSource::Manifest(Box::new((resource, replay)))))
        }
        (None, Some(k)) => endpoints
            .redis_url
            .clone()
            .map(|url| (url, AuditSource::Key(k.to_string())))
            .ok_or_else(|| Error::Config("--key needs --redis-url or REDIS_URL".into())),
        (None, None) => Err(Error::Config("give -f MANIFEST or --key KEY".into())),
    }
}

pub(super) async fn audit(args: AuditArgs) -> Result<ExitCode, Error> {
    let (redis_url, source) = audit_source(&args.trail)?;
    // One connection for the key (a manifest's replay) and the rows, made only if one needs it.
    let mut redis = None;
    let key = match (args.trail.key.clone(), source) {
        (Some(k), _) | (None, AuditSource::Key(k)) => k,
        (None, AuditSource::Manifest(m)) => {
            let replay = &m.1;
            let con = store::connect(&redis_url).await?;
            let layout = con.layout();
            let state = store::Store::peek(con.clone(), &replay.namespace, &replay.state_name())
                .await?
                .ok_or_else(|| {
                    Error::Config(format!(
                        "replay {}/{} has never run",
                        replay.namespace, replay.name
                    ))
                })?;
            redis = Some(con);
            store::Keys::audit_of(
                layout,
                &replay.namespace,
                &replay.state_name(),
                &state.replay_id,
            )
        }
    };
    let rows = match &args.trail.log {
        Some(path) => store::rows_of_log(&read_log(path)?, key.rsplit('/').next()),
        None => {
            let mut con = match redis {
                Some(con) => con,
                None => store::connect(&redis_url).await?,
            };
            store::read_audit(&mut con, &key).await?
        }
    };
    let mut out = std::io::stdout().lock();
    write_audit(&mut out, &rows, args.format).map_err(|e| Error::Io(e.to_string()))?;
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn report(args: ReportArgs) -> Result<ExitCode, Error> {
    use crate::report;
    let (redis_url, source) = audit_source(&args.trail)?;
    let meta = match source {
        AuditSource::Manifest(m) => report::load::meta_of(&m.0),
        AuditSource::Key(k) => {
            let (namespace, name) = report::load::names_of_key(&k).ok_or_else(|| {
                Error::Config(format!(
                    "--key {k:?}: not an audit key (dlq:audit:<namespace>/<name>/<replay id>)"
                ))
            })?;
            report::Meta {
                namespace,
                name,
                ..report::Meta::default()
            }
        }
    };
    let (meta, status, mut rows) =
        report::load::load(&redis_url, meta, args.trail.key.as_deref()).await?;
    if let Some(path) = &args.trail.log {
        rows = store::rows_of_log(&read_log(path)?, status.replay_id.as_deref());
    }
    let (model, bytes) = report::write(meta, &status, &rows, args.format, args.output.as_deref())
        .map_err(Error::Io)?;
    if let Some(path) = &args.output {
        eprintln!(
            "report of {}/{} ({} audit rows, {bytes} bytes): {}",
            model.meta.namespace,
            model.meta.name,
            rows.len(),
            path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The text of a log file, or of standard input for `-`.
fn read_log(path: &str) -> Result<String, Error> {
    use std::io::Read as _;
    let mut text = String::new();
    let read = if path == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::read_to_string(path).map(|t| text = t)
    };
    read.map_err(|e| Error::Io(format!("--log {path}: {e}")))?;
    Ok(text)
}

/// Write audit rows as JSON lines or CSV.
pub fn write_audit(
    out: &mut impl std::io::Write,
    rows: &[store::AuditRow],
    format: AuditFormat,
) -> std::io::Result<()> {
    match format {
        AuditFormat::Jsonl => {
            for r in rows {
                writeln!(out, "{}", serde_json::to_string(r).unwrap_or_default())?;
            }
        }
        AuditFormat::Csv => {
            writeln!(
                out,
                "id,replay,message,decision,key,reason,destination,canary,time,signature"
            )?;
            for r in rows {
                let cells = [
                    &r.id,
                    &r.replay,
                    &r.message,
                    &r.decision,
                    &r.key,
                    &r.reason,
                    &r.destination,
                ];
                let mut line: Vec<String> = cells.iter().map(|c| csv_cell(c)).collect();
                line.push(r.canary.to_string());
                line.push(csv_cell(&r.time));
                line.push(csv_cell(&r.signature));
                writeln!(out, "{}", line.join(","))?;
            }
        }
    }
    Ok(())
}

fn csv_cell(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}
