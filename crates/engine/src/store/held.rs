//! What an idempotency key's value means, to every reader of the store.

/// The value a replay attempt claims its keys with (`<replay id>/<attempt>`): [`Held::of`]
/// reads it back.
pub fn claim_value(replay_id: &str, attempt: u64) -> String {
    format!("{replay_id}/{attempt}")
}

/// The value a claim takes once its publish is confirmed.
pub fn confirmed_claim(claim: &str) -> String {
    format!("{claim}{PUBLISHED}")
}

/// What a confirmed claim's value ends with.
const PUBLISHED: &str = "+published";

/// What an idempotency key's value says, to anyone but the replay attempt that holds it: the one
/// rule by which the drain, the canary and `plan` tell a duplicate from a key whose work may
/// never have gone out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// No value: the key is free.
    Free,
    /// The worker marked it done.
    Done,
    /// Claimed by a replay (`<replay id>/<attempt>`) whose publish is confirmed: a duplicate.
    Published(String),
    /// Claimed by a replay whose publish was never confirmed (a crash, a failed publish): it
    /// may never have gone out, so nothing may be dropped on its account.
    Unconfirmed(String),
    /// Some other value (Claim mode: held by something else): a duplicate.
    Other(String),
}

impl Held {
    /// Read a key's value (`None`: no value) with the worker's done value.
    pub fn of(value: Option<&str>, done: &str) -> Self {
        let Some(v) = value else {
            return Held::Free;
        };
        if v == done {
            return Held::Done;
        }
        let claim = v.strip_suffix(PUBLISHED).unwrap_or(v);
        let is_claim = claim.split_once('/').is_some_and(|(id, attempt)| {
            id.len() == 32
                && id.bytes().all(|b| b.is_ascii_hexdigit())
                && !attempt.is_empty()
                && attempt.bytes().all(|b| b.is_ascii_digit())
        });
        match (is_claim, claim.len() < v.len()) {
            (true, true) => Held::Published(claim.to_string()),
            (true, false) => Held::Unconfirmed(claim.to_string()),
            (false, _) => Held::Other(v.to_string()),
        }
    }

    /// The replay id of a replay's claim.
    pub fn replay(&self) -> Option<&str> {
        match self {
            Held::Published(c) | Held::Unconfirmed(c) => c.split_once('/').map(|(id, _)| id),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against the real Redis (REDIS_URL, else the local one), under keys of their own.
    use super::*;

    #[test]
    fn a_claim_is_published_only_once_marked_so() {
        let id = "0123456789abcdef0123456789abcdef";
        let claim = claim_value(id, 2);
        assert_eq!(Held::of(None, "done"), Held::Free);
        assert_eq!(Held::of(Some("done"), "done"), Held::Done);
        assert_eq!(
            Held::of(Some(&claim), "done"),
            Held::Unconfirmed(claim.clone())
        );
        let published = confirmed_claim(&claim);
        assert_eq!(
            Held::of(Some(&published), "done"),
            Held::Published(claim.clone())
        );
        assert_eq!(Held::of(Some(&published), "done").replay(), Some(id));
        for other in ["processing", "abc/1", "0123/x", &format!("{id}/")] {
            assert_eq!(Held::of(Some(other), "done"), Held::Other(other.into()));
        }
    }
}
