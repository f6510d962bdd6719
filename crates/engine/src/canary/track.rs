//! Where each failure signature stands: met, its canary chosen, out, decided. One place decides
//! what the drain does with a replayable message of a signature ([`Tracker::gate`]), for a fresh
//! replay and for one resumed from its stored verdicts alike. No I/O here.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use crate::spec::{CanaryFailure, CanarySpec};
use crate::status::{CanaryResult, CanaryStatus};

/// Whether a canary's result lets its signature be drained.
fn passed(result: CanaryResult) -> bool {
    matches!(result, CanaryResult::Passed | CanaryResult::Confirmed)
}

/// Where a signature stands.
#[derive(Debug, Clone, PartialEq)]
enum Sig {
    /// One of its messages is on its way as the canary (admitted, not yet published).
    Chosen,
    /// The queue its canary would land on failed the pre-flight (why, which queue).
    Pending(String, String),
    /// Its canary is out (index into the canaries).
    Out(usize),
    /// Its canary's verdict is in (index into the canaries).
    Decided(usize),
}

/// A canary that is out.
#[derive(Debug, Clone)]
struct Out {
    identity: String,
    key: Option<String>,
    deadline: Instant,
    /// Its return can come to the watch queue (a dead-letter route is bound); otherwise the
    /// watched queues are searched when its wait ends.
    watched: bool,
}

/// What the drain does with a replayable message of a signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Replay it: no canary, or its signature's canary passed.
    Go,
    /// The first message of a signature not met before: its canary.
    Canary,
    /// Set it aside until its signature's canary has a verdict.
    Aside,
    /// Leave it in the queue: its signature's canary did not pass.
    Held,
    /// A signature past `canary.maxSignatures`: the replay stops (why).
    TooMany(String),
}

/// The signatures of one replay and their canaries.
#[derive(Debug)]
pub(crate) struct Tracker {
    spec: CanarySpec,
    sigs: HashMap<String, Sig>,
    canaries: Vec<CanaryStatus>,
    out: Vec<Option<Out>>,
    /// Replayable messages met per signature (the status's `messages`).
    met_by_sig: HashMap<String, u64>,
    /// Reading the first look-ahead: everything is set aside until [`Tracker::end_opening`].
    opening: bool,
    opening_met: u64,
    opening_poison: u64,
    /// New signatures met in the first look-ahead, and the queue the first one's canary would
    /// land on.
    opening_sigs: BTreeMap<String, Option<String>>,
    /// Verdicts not stored yet.
    changed: bool,
    /// Counts every change of a canary (sent, decided), for the status to follow.
    pub revision: u64,
    /// Canaries published by this pass, and how many of them came back (the drain's return
    /// ratio is about the messages replayed on the canaries' word, not the canaries).
    pub sent: u64,
    pub came_back: u64,
    /// Messages left in the queue because their signature's canary did not pass, per signature.
    pub held: BTreeMap<String, u64>,
}

impl Tracker {
    /// A replay's signatures, from the verdicts stored by earlier passes. A canary that was
    /// still out when the pass ended is forgotten: its signature gets a new one (its return
    /// could have come while nobody watched).
    pub fn new(spec: &CanarySpec, stored: Vec<CanaryStatus>) -> Self {
        let canaries: Vec<CanaryStatus> = stored
            .into_iter()
            .filter(|c| c.result != CanaryResult::Waiting)
            .collect();
        let sigs = canaries
            .iter()
            .enumerate()
            .map(|(i, c)| (c.signature.clone(), Sig::Decided(i)))
            .collect();
        let met_by_sig = canaries
            .iter()
            .map(|c| (c.signature.clone(), c.messages))
            .collect();
        Self {
            spec: spec.clone(),
            out: vec![None; canaries.len()],
            canaries,
            sigs,
            met_by_sig,
            opening: spec.enabled,
            opening_met: 0,
            opening_poison: 0,
            opening_sigs: BTreeMap::new(),
            changed: false,
            revision: 0,
            sent: 0,
            came_back: 0,
            held: BTreeMap::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.spec.enabled
    }

    /// Whether the first look-ahead is still being read.
    pub fn opening(&self) -> bool {
        self.opening
    }

    /// The most messages set aside at once.
    pub fn look_ahead(&self) -> usize {
        if self.spec.enabled {
            self.spec.look_ahead.max(1) as usize
        } else {
            0
        }
    }

    /// A message met in the first look-ahead: its signature when it is replayable (and the queue
    /// it would land on), and whether it is poison.
    pub fn note_opening(&mut self, signature: Option<&str>, poison: bool, landing: Option<String>) {
        self.opening_met += 1;
        self.opening_poison += u64::from(poison);
        if let Some(s) = signature {
            *self.met_by_sig.entry(s.to_string()).or_default() += 1;
            if !self.sigs.contains_key(s) && !self.opening_sigs.contains_key(s) {
                self.opening_sigs.insert(s.to_string(), landing);
            }
        }
    }

    /// The queues the first look-ahead's canaries would land on (to check before they go).
    pub fn opening_queues(&self) -> Vec<String> {
        let set: BTreeSet<&String> = self.opening_sigs.values().flatten().collect();
        set.into_iter().cloned().collect()
    }

    /// The first look-ahead is read and may go into the drain.
    pub fn end_opening(&mut self) {
        self.opening = false;
    }

    /// What can be decided on the first look-ahead before anything moves (too many signatures,
    /// too much poison). `Err` says why the replay stops.
    pub fn check_opening(&self, max_quarantine_ratio: Option<f64>) -> Result<(), String> {
        let distinct = self.sigs.len() + self.opening_sigs.len();
        if distinct > self.spec.max_signatures as usize {
            return Err(self.too_many(self.opening_met, "before anything moved"));
        }
        if let Some(max) = max_quarantine_ratio {
            let (poison, met) = (self.opening_poison, self.opening_met);
            if met > 0 && poison as f64 / met as f64 > max {
                return Err(format!(
                    "{poison} of the first {met} messages are poison, more than poison.maxQuarantineRatio {max}: the fix is probably not deployed; nothing was replayed"
                ));
            }
        }
        Ok(())
    }

    fn too_many(&self, met: u64, when: &str) -> String {
        let c = &self.spec;
        format!(
            "TooManySignatures: {met} messages already hold more than canary.maxSignatures {} distinct failure signatures (values of header {:?}, else death reason and queue): one canary each would prove nothing; set canary.signatureHeader to a header with fewer values or raise canary.maxSignatures; stopped {when}",
            c.max_signatures, c.signature_header
        )
    }

    /// Count a replayable message met for the first time.
    pub fn count(&mut self, signature: &str) {
        if self.spec.enabled {
            *self.met_by_sig.entry(signature.to_string()).or_default() += 1;
        }
    }

    /// What becomes of a replayable message of `signature` now.
    pub fn gate(&mut self, signature: &str) -> Gate {
        if !self.spec.enabled {
            return Gate::Go;
        }
        match self.sigs.get(signature) {
            None if self.sigs.len() >= self.spec.max_signatures as usize => {
                let met = self.met_by_sig.values().sum();
                Gate::TooMany(self.too_many(met, "there, the rest stays in the queue"))
            }
            None => {
                self.sigs.insert(signature.to_string(), Sig::Chosen);
                Gate::Canary
            }
            Some(Sig::Chosen | Sig::Pending(..) | Sig::Out(_)) => Gate::Aside,
            Some(Sig::Decided(i)) if passed(self.canaries[*i].result) => Gate::Go,
            Some(Sig::Decided(_)) => Gate::Held,
        }
    }

    /// The chosen message did not become the canary (a duplicate, settled before, not sent):
    /// the signature's next message is chosen instead.
    pub fn unchosen(&mut self, signature: &str) {
        if self.sigs.get(signature) == Some(&Sig::Chosen) {
            self.sigs.remove(signature);
        }
    }

    /// The chosen canary's landing queue failed the pre-flight.
    pub fn pending(&mut self, signature: &str, why: String, queue: String) {
        self.sigs
            .insert(signature.to_string(), Sig::Pending(why, queue));
    }

    /// The queues whose pre-flight holds signatures back, and the first reason.
    pub fn pending_queues(&self) -> Option<(String, Vec<String>)> {
        let mut why = None;
        let mut queues = BTreeSet::new();
        for s in self.sigs.values() {
            if let Sig::Pending(w, q) = s {
                why.get_or_insert_with(|| w.clone());
                queues.insert(q.clone());
            }
        }
        why.map(|w| (w, queues.into_iter().collect()))
    }

    /// `queue` passed its pre-flight again: its signatures choose a canary anew.
    pub fn cleared(&mut self, queue: &str) {
        self.sigs
            .retain(|_, s| !matches!(s, Sig::Pending(_, q) if q == queue));
    }

    /// The canary of `signature` was published (confirmed) and recorded: watch it.
    pub fn sent(&mut self, signature: &str, identity: &str, key: Option<&str>, watched: bool) {
        let wait = Duration::from_secs(self.spec.wait_seconds);
        let until = chrono::Utc::now() + chrono::Duration::seconds(self.spec.wait_seconds as i64);
        self.canaries.push(CanaryStatus {
            signature: signature.to_string(),
            message_id: identity.to_string(),
            sent_at: Some(crate::now()),
            wait_until: Some(until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
            result: CanaryResult::Waiting,
            reason: None,
            messages: 0,
        });
        self.out.push(Some(Out {
            identity: identity.to_string(),
            key: key.map(str::to_string),
            deadline: Instant::now() + wait,
            watched,
        }));
        let i = self.canaries.len() - 1;
        self.sigs.insert(signature.to_string(), Sig::Out(i));
        self.sent += 1;
        self.changed = true;
        self.revision += 1;
    }

    /// The canary of `signature` could not be published (nacked, unroutable): its signature is
    /// held back, as if it had come back.
    pub fn not_published(&mut self, signature: &str, identity: &str, why: &str) {
        self.canaries.push(CanaryStatus {
            signature: signature.to_string(),
            message_id: identity.to_string(),
            sent_at: Some(crate::now()),
            wait_until: None,
            result: CanaryResult::DiedAgain,
            reason: Some(format!("canary could not be published: {why}")),
            messages: 0,
        });
        self.out.push(None);
        let i = self.canaries.len() - 1;
        self.sigs.insert(signature.to_string(), Sig::Decided(i));
        self.changed = true;
        self.revision += 1;
    }

    /// A dead letter of this replay came back: when it is a canary that is out, its signature
    /// failed. Returns whether it was one.
    pub fn returned(&mut self, identity: &str, reason: &str) -> bool {
        let Some(i) = self
            .out
            .iter()
            .position(|o| o.as_ref().is_some_and(|o| o.identity == identity))
        else {
            return false;
        };
        self.decide(i, CanaryResult::DiedAgain, Some(reason.to_string()));
        self.came_back += 1;
        true
    }

    /// The keys of the canaries out (Check mode: a key marked done confirms its canary).
    pub fn keys_out(&self) -> Vec<(usize, String)> {
        self.out
            .iter()
            .enumerate()
            .filter_map(|(i, o)| Some((i, o.as_ref()?.key.clone()?)))
            .collect()
    }

    /// The worker marked canary `i`'s key done.
    pub fn confirmed(&mut self, i: usize) {
        if self.out.get(i).is_some_and(Option::is_some) {
            self.decide(i, CanaryResult::Confirmed, None);
        }
    }

    /// Whether a canary whose wait is over had no route to come back by: the watched queues
    /// must be searched before it may pass.
    pub fn unwatched_due(&self) -> bool {
        let now = Instant::now();
        self.out
            .iter()
            .flatten()
            .any(|o| !o.watched && o.deadline <= now)
    }

    /// End the waits that are over: not back, the canary passed (with `requireDone`, not
    /// confirmed: it did not).
    pub fn expire(&mut self) {
        let now = Instant::now();
        let due: Vec<usize> = (0..self.out.len())
            .filter(|&i| self.out[i].as_ref().is_some_and(|o| o.deadline <= now))
            .collect();
        for i in due {
            if self.spec.require_done {
                self.decide(
                    i,
                    CanaryResult::Unconfirmed,
                    Some("the worker did not mark the key done within canary.waitSeconds".into()),
                );
            } else {
                self.decide(i, CanaryResult::Passed, None);
            }
        }
    }

    fn decide(&mut self, i: usize, result: CanaryResult, reason: Option<String>) {
        self.out[i] = None;
        let c = &mut self.canaries[i];
        c.result = result;
        c.reason = reason;
        self.sigs.insert(c.signature.clone(), Sig::Decided(i));
        self.changed = true;
        self.revision += 1;
    }

    /// Whether a canary is chosen or out (its signature's messages wait).
    pub fn waiting(&self) -> bool {
        self.sigs
            .values()
            .any(|s| matches!(s, Sig::Chosen | Sig::Out(_)))
    }

    /// Whether messages of `signature` set aside may go back into the drain (its canary has a
    /// verdict, or it is to choose one).
    pub fn releasable(&self, signature: &str) -> bool {
        !matches!(
            self.sigs.get(signature),
            Some(Sig::Chosen | Sig::Pending(..) | Sig::Out(_))
        )
    }

    /// Whether some signature's canary passed.
    pub fn proven_any(&self) -> bool {
        self.canaries.iter().any(|c| passed(c.result))
    }

    /// The replay ends `CanaryFailed` now (why): a canary failed and `onFailure: StopReplay`, or
    /// every canary failed and none is left to wait for.
    pub fn stop(&self) -> Option<String> {
        let failed: Vec<&CanaryStatus> = self
            .canaries
            .iter()
            .filter(|c| c.result != CanaryResult::Waiting && !passed(c.result))
            .collect();
        let first = failed.first()?;
        let why =
            |c: &CanaryStatus| format!("{}: {}", c.signature, c.reason.clone().unwrap_or_default());
        match self.spec.on_failure {
            CanaryFailure::StopReplay => Some(format!(
                "the canary of {} (canary.onFailure: StopReplay); stopped, the rest stays in the queue",
                why(first)
            )),
            CanaryFailure::HoldSignature
                if !self.proven_any() && !self.waiting() && self.pending_queues().is_none() =>
            {
                let all: Vec<String> = failed.into_iter().map(why).collect();
                Some(format!(
                    "every canary came back ({}); the rest stays in the queue",
                    all.join("; ")
                ))
            }
            CanaryFailure::HoldSignature => None,
        }
    }

    /// Verdicts made since the last call (to be stored).
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The canaries as the status shows them.
    pub fn status(&self) -> Vec<CanaryStatus> {
        self.canaries
            .iter()
            .map(|c| CanaryStatus {
                messages: self.met_by_sig.get(&c.signature).copied().unwrap_or(0),
                ..c.clone()
            })
            .collect()
    }

    /// How many canaries are out.
    pub fn out_count(&self) -> usize {
        self.out.iter().flatten().count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(f: impl FnOnce(&mut CanarySpec)) -> CanarySpec {
        let mut s = CanarySpec::default();
        f(&mut s);
        s
    }

    fn stored(sig: &str, result: CanaryResult) -> CanaryStatus {
        CanaryStatus {
            signature: sig.into(),
            result,
            ..Default::default()
        }
    }

    #[test]
    fn without_the_canary_every_message_goes() {
        let mut t = Tracker::new(&spec(|s| s.enabled = false), vec![]);
        assert!(!t.opening());
        assert_eq!(t.gate("a"), Gate::Go);
        assert_eq!(t.look_ahead(), 0);
    }

    #[test]
    fn the_first_message_of_a_signature_is_its_canary_and_the_rest_wait_for_it() {
        let mut t = Tracker::new(&CanarySpec::default(), vec![]);
        assert_eq!(t.gate("a"), Gate::Canary);
        assert_eq!(t.gate("a"), Gate::Aside);
        assert!(!t.releasable("a"));
        assert!(t.waiting());
        t.sent("a", "m1", None, true);
        assert_eq!(t.gate("a"), Gate::Aside);
        assert!(t.returned("m1", "died again"));
        assert!(t.releasable("a"));
        assert_eq!(t.gate("a"), Gate::Held);
        assert_eq!(t.came_back, 1);
        assert!(t.take_changed());
        assert!(t.stop().is_some(), "every canary came back");
    }

    #[test]
    fn a_chosen_message_that_was_not_sent_lets_the_next_one_be_chosen() {
        let mut t = Tracker::new(&CanarySpec::default(), vec![]);
        assert_eq!(t.gate("a"), Gate::Canary);
        t.unchosen("a");
        assert!(t.releasable("a"));
        assert_eq!(t.gate("a"), Gate::Canary);
    }

    #[test]
    fn a_resumed_replay_keeps_its_verdicts_and_forgets_the_canaries_that_were_out() {
        let mut t = Tracker::new(
            &CanarySpec::default(),
            vec![
                stored("a", CanaryResult::Passed),
                stored("b", CanaryResult::Confirmed),
                stored("c", CanaryResult::DiedAgain),
                stored("d", CanaryResult::Waiting),
            ],
        );
        assert_eq!(t.gate("a"), Gate::Go);
        assert_eq!(t.gate("b"), Gate::Go);
        assert_eq!(t.gate("c"), Gate::Held);
        assert_eq!(t.gate("d"), Gate::Canary, "d's canary was out: a new one");
        assert_eq!(t.status().len(), 3);
    }

    #[test]
    fn waits_end_in_a_pass_or_without_confirmation_a_failure() {
        let mut t = Tracker::new(&spec(|s| s.wait_seconds = 0), vec![]);
        t.gate("a");
        t.sent("a", "m1", Some("k1"), true);
        assert_eq!(t.keys_out(), vec![(0, "k1".to_string())]);
        t.expire();
        assert_eq!(t.gate("a"), Gate::Go);
        assert!(t.proven_any());
        let mut t = Tracker::new(
            &spec(|s| {
                s.wait_seconds = 0;
                s.require_done = true
            }),
            vec![],
        );
        t.gate("a");
        t.sent("a", "m1", Some("k1"), true);
        t.gate("b");
        t.sent("b", "m2", Some("k2"), true);
        t.confirmed(1);
        t.expire();
        let s = t.status();
        assert_eq!(s[0].result, CanaryResult::Unconfirmed);
        assert_eq!(s[1].result, CanaryResult::Confirmed);
        assert_eq!(t.gate("a"), Gate::Held);
        assert!(t.stop().is_none(), "b passed: only a is held");
    }

    #[test]
    fn stop_replay_ends_at_the_first_failure() {
        let mut t = Tracker::new(
            &spec(|s| s.on_failure = CanaryFailure::StopReplay),
            vec![stored("a", CanaryResult::Passed)],
        );
        t.gate("b");
        t.sent("b", "m2", None, true);
        assert!(t.stop().is_none());
        t.returned("m2", "rejected");
        assert!(t.stop().unwrap().contains("StopReplay"));
    }

    #[test]
    fn the_first_look_ahead_decides_signatures_and_poison_before_anything_moves() {
        let mut t = Tracker::new(&spec(|s| s.max_signatures = 2), vec![]);
        for s in ["a", "b", "a"] {
            t.note_opening(Some(s), false, Some("work".into()));
        }
        t.note_opening(None, true, None);
        assert_eq!(t.opening_queues(), vec!["work".to_string()]);
        assert!(t.check_opening(Some(0.5)).is_ok());
        let mut t = Tracker::new(&spec(|s| s.max_signatures = 2), vec![]);
        for s in ["a", "b", "c"] {
            t.note_opening(Some(s), false, Some("work".into()));
        }
        assert!(t
            .check_opening(None)
            .unwrap_err()
            .starts_with("TooManySignatures"));
        let mut t = Tracker::new(&CanarySpec::default(), vec![]);
        t.note_opening(Some("a"), false, None);
        t.note_opening(None, true, None);
        t.note_opening(None, true, None);
        assert!(t
            .check_opening(Some(0.5))
            .unwrap_err()
            .contains("maxQuarantineRatio"));
    }

    #[test]
    fn a_signature_past_the_limit_met_later_stops_the_replay() {
        let mut t = Tracker::new(&spec(|s| s.max_signatures = 1), vec![]);
        assert_eq!(t.gate("a"), Gate::Canary);
        assert!(matches!(t.gate("b"), Gate::TooMany(_)));
    }

    #[test]
    fn a_pending_queue_holds_its_signatures_until_it_clears() {
        let mut t = Tracker::new(&CanarySpec::default(), vec![]);
        t.gate("a");
        t.pending("a", "NoConsumer".into(), "work".into());
        assert_eq!(t.gate("a"), Gate::Aside);
        assert!(!t.waiting());
        assert_eq!(
            t.pending_queues(),
            Some(("NoConsumer".into(), vec!["work".into()]))
        );
        assert!(t.stop().is_none());
        t.cleared("work");
        assert_eq!(t.gate("a"), Gate::Canary);
    }
}
