//! The audit trail: one row per decision, written by the batch's commit (to the replay's Redis
//! stream, or as a JSON line on the log) and read back by `audit`, `report` and the tests.
//!
//! A stream entry holds only what the replay's own record does not: the message, a one-letter
//! decision (upper case for a canary), the idempotency key without the replay's key prefix, the
//! reason, and the destination and failure signature as numbers into the replay's dictionary (a
//! small hash beside the stream, [`super::Keys::dict`]). The replay id is in the stream's key and
//! the time in the entry's id, so neither is stored per row. About 80 bytes a row, where the
//! self-describing rows of earlier versions took about 270 (the bench's `redis` section); those
//! are still read.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::Redis;

use crate::Error;

/// One row of the audit trail.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AuditRow {
    /// The stream entry id (set when read back).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// The replay id.
    pub replay: String,
    /// The message's identity (message id or body hash).
    pub message: String,
    /// replayed, duplicate, quarantined or failed.
    pub decision: String,
    /// The idempotency key, if any.
    pub key: String,
    /// Why.
    pub reason: String,
    /// Where it was published (exchange/routing key, or the quarantine queue).
    pub destination: String,
    /// Whether it was a canary.
    pub canary: bool,
    /// When (RFC 3339, milliseconds).
    pub time: String,
    /// The message's failure signature (as the canary groups messages; see
    /// `spec.canary.signatureHeader`). Empty in rows written before rows named it.
    #[serde(default)]
    pub signature: String,
}

/// What became of a message, as its audit row says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Published to the target, confirmed.
    Replayed,
    /// Dropped: its work already happened (or is claimed).
    Duplicate,
    /// Published to the quarantine queue, confirmed.
    Quarantined,
    /// Its publish failed: it stays in the dead-letter queue.
    Failed,
}

impl Decision {
    /// Every decision.
    pub const ALL: [Decision; 4] = [
        Decision::Replayed,
        Decision::Duplicate,
        Decision::Quarantined,
        Decision::Failed,
    ];

    /// The wire name (audit rows, JSON lines, CSV, the report).
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Replayed => "replayed",
            Decision::Duplicate => "duplicate",
            Decision::Quarantined => "quarantined",
            Decision::Failed => "failed",
        }
    }

    /// The decision of a wire name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.as_str() == name)
    }

    /// The one letter a stream entry keeps: the name's first, upper case for a canary.
    fn code(self, canary: bool) -> &'static str {
        match (self, canary) {
            (Decision::Replayed, false) => "r",
            (Decision::Replayed, true) => "R",
            (Decision::Duplicate, false) => "d",
            (Decision::Duplicate, true) => "D",
            (Decision::Quarantined, false) => "q",
            (Decision::Quarantined, true) => "Q",
            (Decision::Failed, false) => "f",
            (Decision::Failed, true) => "F",
        }
    }

    fn of_code(code: &str) -> Option<(Self, bool)> {
        Self::ALL.into_iter().find_map(|d| {
            [false, true]
                .into_iter()
                .find(|&canary| d.code(canary) == code)
                .map(|canary| (d, canary))
        })
    }
}

/// The field names of a compact stream entry, in order.
pub(super) const FIELDS: [&str; 6] = ["m", "d", "k", "r", "t", "s"];

/// The dictionary field that holds the replay's key prefix.
const PREFIX_FIELD: &str = "p";

/// Turns rows into compact stream entries: the replay's key prefix, and the numbers it gave to
/// the destinations and signatures met so far. Shared by the clones of a [`super::Store`], so
/// that every commit of the replay numbers a value the same way.
#[derive(Debug, Clone, Default)]
pub(super) struct Encoder(Arc<Mutex<Dict>>);

#[derive(Debug, Default)]
struct Dict {
    prefix: String,
    numbers: HashMap<String, usize>,
    values: Vec<String>,
    /// Values below this number are known to be stored (a commit that carried them succeeded);
    /// every commit carries the rest again, so a failed commit loses no definition.
    stored: usize,
}

/// One commit's share of the dictionary: the values it may be the first to store.
pub(super) struct Definitions {
    pub(super) from: usize,
    pub(super) values: Vec<String>,
    pub(super) prefix: String,
}

impl Encoder {
    /// An encoder that continues a stored dictionary (`HGETALL` of it) with `prefix`.
    pub(super) fn new(prefix: &str, stored: HashMap<String, String>) -> Self {
        let mut values: Vec<(usize, String)> = stored
            .into_iter()
            .filter_map(|(k, v)| Some((k.parse().ok()?, v)))
            .collect();
        values.sort_unstable();
        // Numbers are dense from 0; a gap (never written so) ends what is trusted.
        let values: Vec<String> = values
            .into_iter()
            .enumerate()
            .take_while(|(i, (n, _))| i == n)
            .map(|(_, (_, v))| v)
            .collect();
        let numbers = values
            .iter()
            .enumerate()
            .map(|(i, v)| (v.clone(), i))
            .collect();
        Self(Arc::new(Mutex::new(Dict {
            prefix: prefix.into(),
            numbers,
            stored: values.len(),
            values,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Dict> {
        // A poisoned lock only means another thread panicked mid-encode: the map is still whole.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Encode `rows` into `out` (six cells per row, in [`FIELDS`] order), numbering new
    /// values; returns the definitions this commit must store along with them. The cells borrow
    /// from the rows: a row costs no allocation on the commit's path (but a key outside the
    /// prefix or an unknown decision, which never come from the engine).
    pub(super) fn encode<'r>(&self, rows: &'r [AuditRow], out: &mut Vec<Cell<'r>>) -> Definitions {
        let mut d = self.lock();
        let from = d.stored;
        for row in rows {
            let decision = match Decision::parse(&row.decision) {
                Some(dec) => Cell::Text(Cow::Borrowed(dec.code(row.canary))),
                None => Cell::Text(Cow::Owned(format!("={}", row.decision))),
            };
            let key = match row.key.strip_prefix(d.prefix.as_str()) {
                _ if row.key.is_empty() => Cell::Text(Cow::Borrowed("")),
                Some(rest) if !rest.starts_with('=') => Cell::Text(Cow::Borrowed(rest)),
                _ => Cell::Text(Cow::Owned(format!("={}", row.key))),
            };
            let destination = d.number(&row.destination);
            let signature = d.number(&row.signature);
            out.extend([
                Cell::Text(Cow::Borrowed(&row.message)),
                decision,
                key,
                Cell::Text(Cow::Borrowed(&row.reason)),
                destination,
                signature,
            ]);
        }
        Definitions {
            from,
            values: d.values[from..].to_vec(),
            prefix: d.prefix.clone(),
        }
    }

    /// A commit that carried definitions up to `to` succeeded.
    pub(super) fn stored(&self, to: usize) {
        let mut d = self.lock();
        d.stored = d.stored.max(to);
    }
}

impl Dict {
    /// The cell of `value`: its number, or "" for no value.
    fn number(&mut self, value: &str) -> Cell<'static> {
        if value.is_empty() {
            return Cell::Text(Cow::Borrowed(""));
        }
        if let Some(&n) = self.numbers.get(value) {
            return Cell::Number(n);
        }
        let n = self.values.len();
        self.values.push(value.to_string());
        self.numbers.insert(value.to_string(), n);
        Cell::Number(n)
    }
}

/// One value of a compact stream entry, as the commit passes it to Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Cell<'a> {
    /// A text (borrowed from the row where it can be).
    Text(Cow<'a, str>),
    /// A dictionary number (Redis keeps it as the integer's digits).
    Number(usize),
}

impl redis::ToRedisArgs for Cell<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        match self {
            Cell::Text(t) => t.as_ref().write_redis_args(out),
            Cell::Number(n) => n.write_redis_args(out),
        }
    }
}

impl std::fmt::Display for Cell<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cell::Text(t) => f.write_str(t),
            Cell::Number(n) => write!(f, "{n}"),
        }
    }
}

/// Write `rows` to standard error, one JSON object a line, marked `"audit":"dlq-replay"` for
/// the log collector's filter; in one locked write, so no other log line splits a row.
pub(super) fn log_rows(rows: &[AuditRow], namespace: &str, name: &str) -> Result<(), Error> {
    use std::io::Write as _;
    #[derive(serde::Serialize)]
    struct Line<'a> {
        audit: &'static str,
        namespace: &'a str,
        name: &'a str,
        #[serde(flatten)]
        row: &'a AuditRow,
    }
    let mut text = String::new();
    for row in rows {
        let line = Line {
            audit: "dlq-replay",
            namespace,
            name,
            row,
        };
        text.push_str(&serde_json::to_string(&line).map_err(|e| Error::Io(e.to_string()))?);
        text.push('\n');
    }
    let mut err = std::io::stderr().lock();
    err.write_all(text.as_bytes())
        .and_then(|()| err.flush())
        .map_err(|e| Error::Io(format!("writing audit rows to the log: {e}")))
}

/// Read audit rows back from log lines (`dlq-replay audit --log FILE`): the lines marked as
/// audit rows of `replay_id` (any replay when `None`), in the order written. Other lines, and
/// a line a log collector wrapped (a JSON object whose `log` or `message` field holds the row),
/// are looked into too; what is not a row is passed over.
pub fn rows_of_log(text: &str, replay_id: Option<&str>) -> Vec<AuditRow> {
    text.lines()
        .filter_map(|line| {
            let start = line.find('{')?;
            let v: serde_json::Value = serde_json::from_str(&line[start..]).ok()?;
            let v = if v.get("audit").is_some() {
                v
            } else {
                ["log", "message"]
                    .iter()
                    .find_map(|f| v.get(f)?.as_str())
                    .and_then(|s| serde_json::from_str(s).ok())?
            };
            (v.get("audit")?.as_str()? == "dlq-replay").then_some(())?;
            let row: AuditRow = serde_json::from_value(v).ok()?;
            replay_id.is_none_or(|id| row.replay == id).then_some(row)
        })
        .collect()
}

/// Read an audit stream, oldest first (`dict`: its dictionary, `HGETALL` of
/// [`super::Keys::dict`]; empty for rows of earlier versions, which describe themselves).
pub async fn read_audit(con: &mut Redis, key: &str) -> Result<Vec<AuditRow>, Error> {
    let dict: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(super::Keys::dict_of_audit(key))
        .query_async(con)
        .await?;
    let replay = key.rsplit('/').next().unwrap_or_default().to_string();
    let mut rows = Vec::new();
    let mut start = "-".to_string();
    loop {
        let page: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(key)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(con)
            .await?;
        let Some((last, _)) = page.last() else { break };
        start = format!("({last}");
        let done = page.len() < 1000;
        rows.extend(
            page.into_iter()
                .map(|(id, fields)| row_of(id, fields, &replay, &dict)),
        );
        if done {
            break;
        }
    }
    Ok(rows)
}

fn row_of(
    id: String,
    fields: Vec<(String, String)>,
    replay: &str,
    dict: &HashMap<String, String>,
) -> AuditRow {
    let mut row = AuditRow {
        replay: replay.to_string(),
        time: time_of_id(&id),
        id,
        ..Default::default()
    };
    let value = |n: &str| dict.get(n).cloned().unwrap_or_default();
    for (f, v) in fields {
        match f.as_str() {
            "m" | "message" => row.message = v,
            "d" => match Decision::of_code(&v) {
                Some((d, canary)) => (row.decision, row.canary) = (d.as_str().into(), canary),
                None => row.decision = v.strip_prefix('=').unwrap_or(&v).to_string(),
            },
            "k" => {
                row.key = match v.strip_prefix('=') {
                    Some(whole) => whole.to_string(),
                    None if v.is_empty() => v,
                    None => format!("{}{v}", value(PREFIX_FIELD)),
                }
            }
            "r" | "reason" => row.reason = v,
            "t" => row.destination = value(&v),
            "s" => row.signature = value(&v),
            // The self-describing rows of earlier versions.
            "replay" => row.replay = v,
            "decision" => row.decision = v,
            "key" => row.key = v,
            "destination" => row.destination = v,
            "canary" => row.canary = v == "true",
            "time" => row.time = v,
            "signature" => row.signature = v,
            _ => {}
        }
    }
    row
}

/// The time of a stream entry id (`<ms>-<seq>`), as rows say times.
fn time_of_id(id: &str) -> String {
    id.split('-')
        .next()
        .and_then(|ms| ms.parse::<i64>().ok())
        .and_then(chrono::DateTime::from_timestamp_millis)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

/// The dictionary fields a commit writes: the prefix, then each new value under its number.
pub(super) fn definition_fields(defs: &Definitions) -> Vec<String> {
    let mut out = vec![PREFIX_FIELD.to_string(), defs.prefix.clone()];
    for (i, v) in defs.values.iter().enumerate() {
        out.push((defs.from + i).to_string());
        out.push(v.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(canary: bool, decision: Decision) -> AuditRow {
        AuditRow {
            replay: "r1".into(),
            message: "m-1".into(),
            decision: decision.as_str().into(),
            key: "idem:0123456789abcdef0123456789abcdef".into(),
            reason: "why".into(),
            destination: "media/work".into(),
            canary,
            time: String::new(),
            signature: "x-exception-type=TimeoutError".into(),
            id: String::new(),
        }
    }

    fn decode(values: &[Cell], defs: &Definitions) -> AuditRow {
        let fields = FIELDS
            .iter()
            .zip(values)
            .map(|(f, v)| (f.to_string(), v.to_string()))
            .collect();
        let dict: HashMap<String, String> = definition_fields(defs)
            .chunks(2)
            .map(|p| (p[0].clone(), p[1].clone()))
            .collect();
        row_of("1733300000123-0".into(), fields, "r1", &dict)
    }

    #[test]
    fn a_compact_row_reads_back_as_written() {
        for d in Decision::ALL {
            for canary in [false, true] {
                let enc = Encoder::new("idem:", HashMap::new());
                let mut out = Vec::new();
                let row = full(canary, d);
                let defs = enc.encode(std::slice::from_ref(&row), &mut out);
                assert_eq!(out.len(), FIELDS.len());
                assert_eq!(
                    out[2].to_string(),
                    "0123456789abcdef0123456789abcdef",
                    "prefix dropped"
                );
                let back = decode(&out, &defs);
                assert_eq!(back.time, "2024-12-04T08:13:20.123Z");
                assert_eq!(
                    AuditRow {
                        id: String::new(),
                        time: String::new(),
                        ..back
                    },
                    row
                );
            }
        }
    }

    #[test]
    fn keys_without_the_prefix_and_unknown_decisions_are_kept_whole() {
        let enc = Encoder::new("idem:", HashMap::new());
        let mut out = Vec::new();
        let mut row = full(false, Decision::Replayed);
        row.key = "other:abc".into();
        row.decision = "held".into();
        row.destination = String::new();
        let defs = enc.encode(std::slice::from_ref(&row), &mut out);
        let back = decode(&out, &defs);
        assert_eq!(back.key, "other:abc");
        assert_eq!(back.decision, "held");
        assert_eq!(back.destination, "");
    }

    #[test]
    fn values_are_numbered_once_and_carried_until_stored() {
        let enc = Encoder::new("p:", HashMap::new());
        let mut out = Vec::new();
        let rows = [
            full(false, Decision::Replayed),
            full(true, Decision::Failed),
        ];
        let first = enc.encode(&rows, &mut out);
        assert_eq!(first.from, 0);
        assert_eq!(first.values.len(), 2, "destination and signature");
        assert_eq!(&out[4..6], &out[10..12], "same values, same numbers");
        // Not stored yet: the next commit carries them again.
        assert_eq!(enc.encode(&rows, &mut out).values.len(), 2);
        enc.stored(2);
        assert!(enc.encode(&rows, &mut out).values.is_empty());
        // A resumed replay continues the stored numbering.
        let stored = HashMap::from([
            ("p".to_string(), "p:".to_string()),
            ("0".to_string(), "media/work".to_string()),
        ]);
        let again = Encoder::new("p:", stored);
        let mut out = Vec::new();
        let defs = again.encode(&rows[..1], &mut out);
        assert_eq!(out[4], Cell::Number(0));
        assert_eq!((defs.from, defs.values.len()), (1, 1));
    }

    #[test]
    fn log_lines_read_back_even_when_wrapped_by_a_collector() {
        let row = AuditRow {
            time: "2026-12-04T10:00:00.000Z".into(),
            ..full(false, Decision::Duplicate)
        };
        let line = serde_json::json!({"audit": "dlq-replay", "namespace": "n", "name": "x"});
        let mut line = line.as_object().cloned().unwrap_or_default();
        if let serde_json::Value::Object(fields) = serde_json::to_value(&row).unwrap() {
            line.extend(fields);
        }
        let raw = serde_json::Value::Object(line).to_string();
        let wrapped = serde_json::json!({"log": raw.clone(), "stream": "stderr"}).to_string();
        let text = format!("noise\n{raw}\n2026-12-04T10:00:00Z INFO x\n{wrapped}\n");
        assert_eq!(rows_of_log(&text, Some("r1")), vec![row.clone(), row]);
        assert!(rows_of_log(&text, Some("other")).is_empty());
    }
}
