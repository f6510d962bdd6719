//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it.
//!
//! A follower asks for the Lease every `retry` (2 s): it takes it when it is free (no holder, as a
//! released Lease is) or when the holder has not renewed it for `duration` (15 s) as measured on
//! this replica's own clock since it last saw the record change (so clock skew between nodes does
//! not matter). The leader renews it every `retry`, and stops leading when it could not renew it
//! for `renew_deadline` (10 s): before any other replica may take it. Every write is an update
//! with the resourceVersion that was read, so two replicas never both succeed.
//!
//! On a clean shutdown the leader releases the Lease (no holder, a 1 s duration, as client-go
//! does), and the other replica takes over at its next ask instead of after the lease expired.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use kube::Client;

/// How one Lease is held.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// The Lease's name.
    pub name: String,
    /// The Lease's namespace.
    pub namespace: String,
    /// This replica's identity (the pod name).
    pub identity: String,
    /// How long a Lease nobody renewed stays held.
    pub duration: Duration,
    /// How long the leader tries to renew before it gives up leading (less than `duration`).
    pub renew_deadline: Duration,
    /// How often followers ask and the leader renews.
    pub retry: Duration,
}

impl LeaseConfig {
    /// The defaults of client-go: 15 s, 10 s, 2 s.
    pub fn new(name: &str, namespace: &str, identity: &str) -> Self {
        Self {
            name: name.into(),
            namespace: namespace.into(),
            identity: identity.into(),
            duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry: Duration::from_secs(2),
        }
    }
}

/// What was last seen of the Lease, and when (on this replica's clock).
#[derive(Clone, Debug, PartialEq)]
struct Record {
    holder: Option<String>,
    renew: Option<MicroTime>,
    duration: Option<i32>,
    transitions: Option<i32>,
}

impl Record {
    fn of(lease: &Lease) -> Self {
        let spec = lease.spec.clone().unwrap_or_default();
        Self {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            renew: spec.renew_time,
            duration: spec.lease_duration_seconds,
            transitions: spec.lease_transitions,
        }
    }
}

/// One replica's side of the election.
pub struct Elector {
    api: Api<Lease>,
    cfg: LeaseConfig,
    observed: Option<(Record, Instant)>,
    /// When this replica last renewed (or acquired) the Lease.
    renewed: Option<Instant>,
}

fn now() -> MicroTime {
    let micros = chrono::Utc::now().timestamp_micros();
    MicroTime(k8s_openapi::jiff::Timestamp::from_microsecond(micros).unwrap_or_default())
}

impl Elector {
    /// An elector for `cfg` (nothing is asked yet).
    pub fn new(client: Client, cfg: LeaseConfig) -> Self {
        Self {
            api: Api::namespaced(client, &cfg.namespace),
            cfg,
            observed: None,
            renewed: None,
        }
    }

    /// How this elector holds its Lease.
    pub fn config(&self) -> &LeaseConfig {
        &self.cfg
    }

    /// Whether the last renewal is older than the renew deadline (or there was none): a leader
    /// in that state must stop leading.
    pub fn renewal_overdue(&self) -> bool {
        self.renewed
            .is_none_or(|t| t.elapsed() >= self.cfg.renew_deadline)
    }

    /// One ask: take the Lease if it is free or expired, renew it if it is ours. `Ok(true)` when
    /// this replica holds it now. Each call is bounded by `retry` plus a few seconds.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let bound = self.cfg.retry + Duration::from_secs(3);
        match tokio::time::timeout(bound, self.ask()).await {
            Ok(r) => r,
            Err(_) => Err(kube::Error::Service(
                format!("the Lease did not answer within {}s", bound.as_secs()).into(),
            )),
        }
    }

    async fn ask(&mut self) -> Result<bool, kube::Error> {
        let me = self.cfg.identity.clone();
        let Some(mut lease) = self.api.get_opt(&self.cfg.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.cfg.name.clone()),
                    namespace: Some(self.cfg.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(None, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => Ok(self.took(&created)),
                Err(kube::Error::Api(s)) if s.is_already_exists() || s.is_conflict() => Ok(false),
                Err(e) => Err(e),
            };
        };
        let record = Record::of(&lease);
        if self.observed.as_ref().map(|(r, _)| r) != Some(&record) {
            self.observed = Some((record.clone(), Instant::now()));
        }
        let mine = record.holder.as_deref() == Some(me.as_str());
        if let (Some(_), false) = (&record.holder, mine) {
            let seen = self
                .observed
                .as_ref()
                .map_or_else(Instant::now, |(_, t)| *t);
            let lasts = Duration::from_secs(record.duration.unwrap_or(0).max(0) as u64);
            if seen.elapsed() < lasts {
                self.renewed = None;
                return Ok(false);
            }
        }
        let old = lease.spec.clone().unwrap_or_default();
        let transitions = old.lease_transitions.unwrap_or(0);
        lease.spec = Some(if mine {
            LeaseSpec {
                renew_time: Some(now()),
                lease_duration_seconds: Some(self.cfg.duration.as_secs() as i32),
                ..old
            }
        } else {
            self.spec(old.preferred_holder, transitions + 1)
        });
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(updated) => Ok(self.took(&updated)),
            // Someone else wrote it first. A follower asks again next time; a leader's renewal
            // failed, which it retries until its renew deadline (the error says so).
            Err(kube::Error::Api(s)) if s.is_conflict() && !mine => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn spec(&self, preferred: Option<String>, transitions: i32) -> LeaseSpec {
        let t = now();
        LeaseSpec {
            holder_identity: Some(self.cfg.identity.clone()),
            acquire_time: Some(t.clone()),
            renew_time: Some(t),
            lease_duration_seconds: Some(self.cfg.duration.as_secs() as i32),
            lease_transitions: Some(transitions),
            preferred_holder: preferred,
            strategy: None,
        }
    }

    fn took(&mut self, lease: &Lease) -> bool {
        self.observed = Some((Record::of(lease), Instant::now()));
        self.renewed = Some(Instant::now());
        true
    }

    /// Give the Lease up if this replica holds it: no holder, a 1 s duration, so that the other
    /// replicas take it at their next ask. Bounded like [`Elector::try_acquire_or_renew`].
    pub async fn release(&mut self) -> Result<bool, kube::Error> {
        let bound = self.cfg.retry + Duration::from_secs(3);
        let released = tokio::time::timeout(bound, self.give_up()).await;
        self.renewed = None;
        match released {
            Ok(r) => r,
            Err(_) => Err(kube::Error::Service(
                format!("the Lease did not answer within {}s", bound.as_secs()).into(),
            )),
        }
    }

    async fn give_up(&mut self) -> Result<bool, kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.cfg.name).await? else {
            return Ok(false);
        };
        let Some(old) = lease.spec.clone() else {
            return Ok(false);
        };
        if old.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
            return Ok(false);
        }
        let t = now();
        lease.spec = Some(LeaseSpec {
            holder_identity: None,
            acquire_time: Some(t.clone()),
            renew_time: Some(t),
            lease_duration_seconds: Some(1),
            ..old
        });
        self.api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await?;
        self.observed = None;
        Ok(true)
    }
}
