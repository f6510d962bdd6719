//! Which failure signatures the drain may replay, as the canaries decided: one place decides
//! it, for a fresh drain and for one resumed from the stored canary results alike.

use std::collections::HashSet;

use crate::status::{CanaryResult, CanaryStatus};

/// Whether a canary's result lets its signature be drained.
fn passed(result: CanaryResult) -> bool {
    matches!(result, CanaryResult::Passed | CanaryResult::Confirmed)
}

/// Which failure signatures the drain may replay.
#[derive(Debug, Clone, Default)]
pub enum Proven {
    /// No canary ran (disabled, or nothing to canary): every signature.
    #[default]
    All,
    /// The signatures whose canary passed. Every other one stays in the queue: one whose canary
    /// failed, and one no canary met because its first message arrived after the canaries were
    /// chosen (another failing service's dead letters, say): nothing proved the fix for it.
    Only {
        passed: HashSet<String>,
        failed: HashSet<String>,
    },
}

impl Proven {
    /// From the canaries' results (none: every signature).
    pub fn of(canaries: &[CanaryStatus]) -> Self {
        if canaries.is_empty() {
            return Self::All;
        }
        let (ok, not): (Vec<_>, Vec<_>) = canaries.iter().partition(|c| passed(c.result));
        let names = |v: Vec<&CanaryStatus>| v.into_iter().map(|c| c.signature.clone()).collect();
        Self::Only {
            passed: names(ok),
            failed: names(not),
        }
    }

    /// Canaries ran and none passed: nothing is to be drained.
    pub fn none_passed(&self) -> bool {
        matches!(self, Self::Only { passed, .. } if passed.is_empty())
    }

    /// Whether a message of `signature` is held back, and why; `None` when it may be replayed.
    pub fn hold(&self, signature: &str) -> Option<Hold> {
        match self {
            Self::All => None,
            Self::Only { passed, .. } if passed.contains(signature) => None,
            Self::Only { failed, .. } if failed.contains(signature) => Some(Hold::Failed),
            Self::Only { .. } => Some(Hold::Unproven),
        }
    }
}

/// Why the drain leaves a replayable message in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// The canary of its signature came back (or was not confirmed).
    Failed,
    /// No canary met its signature.
    Unproven,
}

impl Hold {
    /// The skip reason recorded for the message.
    pub fn reason(self, signature: &str) -> String {
        match self {
            Self::Failed => "held back: the canary of its signature did not pass".into(),
            Self::Unproven => format!(
                "held back: no canary proved its signature {signature:?} (its first message arrived after the canaries were chosen)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canary(signature: &str, result: CanaryResult) -> CanaryStatus {
        CanaryStatus {
            signature: signature.into(),
            result,
            ..Default::default()
        }
    }

    #[test]
    fn without_canaries_every_signature_goes() {
        assert_eq!(Proven::of(&[]).hold("x-exception-type=KeyError"), None);
    }

    #[test]
    fn only_passed_or_confirmed_signatures_go() {
        let p = Proven::of(&[
            canary("a", CanaryResult::Passed),
            canary("b", CanaryResult::Confirmed),
            canary("c", CanaryResult::DiedAgain),
            canary("d", CanaryResult::Unconfirmed),
        ]);
        assert_eq!(p.hold("a"), None);
        assert_eq!(p.hold("b"), None);
        assert_eq!(p.hold("c"), Some(Hold::Failed));
        assert_eq!(p.hold("d"), Some(Hold::Failed));
        assert_eq!(p.hold("e"), Some(Hold::Unproven));
        assert!(!p.none_passed());
        assert!(Proven::of(&[canary("c", CanaryResult::DiedAgain)]).none_passed());
        assert!(!Proven::of(&[]).none_passed());
        assert!(Hold::Unproven
            .reason("e")
            .contains("no canary proved its signature \"e\""));
    }
}
