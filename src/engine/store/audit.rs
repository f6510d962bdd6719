//! The audit trail: one stream entry per decision, written by the batch's commit and read back
//! by `audit`, `report` and the tests.

use redis::aio::ConnectionManager;

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

impl AuditRow {
    pub(super) const FIELDS: [&'static str; 9] = [
        "replay",
        "message",
        "decision",
        "key",
        "reason",
        "destination",
        "canary",
        "time",
        "signature",
    ];

    pub(super) fn values(&self) -> [&str; 9] {
        [
            &self.replay,
            &self.message,
            &self.decision,
            &self.key,
            &self.reason,
            &self.destination,
            if self.canary { "true" } else { "false" },
            &self.time,
            &self.signature,
        ]
    }
}

/// Read an audit stream, oldest first.
pub async fn read_audit(con: &mut ConnectionManager, key: &str) -> Result<Vec<AuditRow>, Error> {
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
        rows.extend(page.into_iter().map(|(id, fields)| row_of(id, fields)));
        if done {
            break;
        }
    }
    Ok(rows)
}

fn row_of(id: String, fields: Vec<(String, String)>) -> AuditRow {
    let mut row = AuditRow {
        id,
        ..Default::default()
    };
    for (f, v) in fields {
        match f.as_str() {
            "replay" => row.replay = v,
            "message" => row.message = v,
            "decision" => row.decision = v,
            "key" => row.key = v,
            "reason" => row.reason = v,
            "destination" => row.destination = v,
            "canary" => row.canary = v == "true",
            "time" => row.time = v,
            "signature" => row.signature = v,
            _ => {}
        }
    }
    row
}
