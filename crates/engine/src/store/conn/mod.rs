//! The connection to the replay's Redis, in the three forms users run it: one server, a Sentinel
//! group (a master that can change), or a Redis Cluster (keys spread over hash slots).
//!
//! The URL's scheme picks the form:
//!
//! - `redis://[user:pass@]host:6379/0` (`rediss://` with TLS): one server.
//! - `redis+sentinel://[user:pass@]s1:26379,s2:26379,s3:26379/<master name>[/db]`
//!   (`rediss+sentinel://`): the master the sentinels name, asked again when it is lost or
//!   turns read-only (a failover). The user and password are the master's; `sentinel_username`
//!   and `sentinel_password` in the query are the sentinels' own, if they need any.
//! - `redis+cluster://[user:pass@]n1:7000,n2:7001,n3:7002` (`rediss+cluster://`): any nodes of
//!   the cluster; the client learns the rest and follows the slots as they move.
//!
//! `?replicas=N` (every form) is how many replicas must hold a write before the replay relies on
//! it ([`Redis::replicas`]): 1 by default behind Sentinel and in a Cluster, 0 for one server.
//!
//! [`Redis`] is a [`redis::aio::ConnectionLike`], so commands and pipelines run on it as on any
//! redis-rs connection. A Cluster pipeline whose keys span slots is sent one command at a time,
//! all at once (redis-rs sends a pipeline to one node only).

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use futures::FutureExt;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

use crate::Error;

mod ha;
use ha::{Cluster, Sentinel};

/// Longer than a busy Redis takes to answer a batch's script, short enough that a Redis that
/// stopped answering ends the call (and it is asked again, or the replay reconnects) instead of
/// hanging it.
const TIMEOUT: Duration = Duration::from_secs(5);

/// How long a `WAIT` for replicas may block before the write is taken as not yet replicated.
const WAIT_MS: u64 = 2000;

/// A connection to the replay's Redis (a clone shares it).
#[derive(Clone)]
pub struct Redis {
    inner: Inner,
    replicas: u64,
    /// In a Cluster: the generation of the connection this clone's last call went over (see
    /// `ha::Cluster`), so that a `WAIT` after a write goes over the write's connection.
    used: u64,
}

#[derive(Clone)]
enum Inner {
    Single(ConnectionManager),
    Sentinel(Arc<Sentinel>),
    Cluster(Arc<Cluster>),
}

/// How the replay's keys are named: with their replay's name as a `{hash tag}` in a Cluster, so
/// that the keys one script touches share a slot; without one elsewhere, as they always were.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// One server or a Sentinel group: `dlq:replay:ns/name`.
    #[default]
    Flat,
    /// A Redis Cluster: `dlq:replay:{ns/name}`.
    Tagged,
}

/// Connect to Redis; the error never repeats the URL's password.
pub async fn connect(url: &str) -> Result<Redis, Error> {
    crate::tls::install_provider();
    let (url, replicas) = take_replicas(url)?;
    let scheme = url.split("://").next().unwrap_or("");
    let (inner, default_replicas) = match scheme {
        "redis+sentinel" | "rediss+sentinel" => (Inner::Sentinel(Sentinel::new(&url).await?), 1),
        "redis+cluster" | "rediss+cluster" => (Inner::Cluster(Cluster::new(&url).await?), 1),
        _ => (Inner::Single(single(&url).await?), 0),
    };
    Ok(Redis {
        inner,
        replicas: replicas.unwrap_or(default_replicas),
        used: 0,
    })
}

impl Redis {
    /// How many replicas must hold a write (a claim, a batch's outcome) before the replay acts on
    /// it: a claim only kept by a master that then fails over would be free again on the new
    /// master, and the key could be published twice.
    pub fn replicas(&self) -> u64 {
        self.replicas
    }

    /// How the replay's keys are named on this Redis.
    pub fn layout(&self) -> Layout {
        match self.inner {
            Inner::Cluster(_) => Layout::Tagged,
            _ => Layout::Flat,
        }
    }

    /// Whether a script may touch keys of different replays or of the workers together (not in
    /// a Cluster, where a script's keys must share a slot).
    pub fn spans_slots(&self) -> bool {
        !matches!(self.inner, Inner::Cluster(_))
    }
}

/// The `replicas` query parameter, taken out of the URL (the client libraries do not know it).
fn take_replicas(url: &str) -> Result<(String, Option<u64>), Error> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), None));
    };
    let mut replicas = None;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("replicas", n)) => {
                replicas = Some(n.parse::<u64>().map_err(|_| {
                    Error::Config(format!(
                        "Redis URL: replicas={n:?} is not a number of replicas"
                    ))
                })?)
            }
            _ => rest.push(pair),
        }
    }
    let url = if rest.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((url, replicas))
}

fn bad_url(e: RedisError) -> Error {
    Error::Redis(format!("bad Redis URL: {:?}", e.kind()))
}

fn cannot_connect(e: RedisError) -> Error {
    if crate::redis_connection_lost(&e) {
        Error::Connection(crate::tls::hint(format!("redis: cannot connect: {e}")))
    } else {
        Error::Redis(crate::tls::hint(e.to_string()))
    }
}

async fn single(url: &str) -> Result<ConnectionManager, Error> {
    if crate::endpoints::hosts(url).is_some() {
        return Err(Error::Config(
            "Redis URL: several hosts need redis+sentinel:// (sentinels) or redis+cluster:// (cluster nodes)".into(),
        ));
    }
    let client = redis::Client::open(url).map_err(bad_url)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_response_timeout(Some(TIMEOUT))
        .set_connection_timeout(Some(TIMEOUT));
    client
        .get_connection_manager_with_config(config)
        .await
        .map_err(cannot_connect)
}

/// The endpoints of a `+sentinel`/`+cluster` URL as plain `redis://` (or `rediss://`) URLs with
/// the credentials given, and what follows the hosts.
fn nodes(url: &str, credentials: Option<&str>) -> Result<(Vec<String>, String), Error> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let plain = if scheme.starts_with("rediss") {
        "rediss"
    } else {
        "redis"
    };
    let one = format!("{plain}://{rest}");
    let (head, hosts, tail) =
        crate::endpoints::parts(&one).ok_or_else(|| Error::Config("Redis URL: no host".into()))?;
    if hosts.iter().any(|h| h.is_empty()) {
        return Err(Error::Config("Redis URL: an empty host".into()));
    }
    let all = hosts.iter().map(|h| with(head, h, credentials)).collect();
    Ok((all, tail.to_string()))
}

/// `head` (`scheme://userinfo@`) and a host as one URL, its userinfo replaced by `credentials`
/// when given.
fn with(head: &str, host: &str, credentials: Option<&str>) -> String {
    let scheme = head.split("://").next().unwrap_or("redis");
    match credentials {
        Some(c) if !c.is_empty() => format!("{scheme}://{c}@{host}"),
        Some(_) => format!("{scheme}://{host}"),
        None => format!("{head}{host}"),
    }
}

impl ConnectionLike for Redis {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.inner {
            Inner::Single(c) => c.req_packed_command(cmd),
            Inner::Cluster(c) => c
                .clone()
                .call(&mut self.used, move |mut con| {
                    async move { con.req_packed_command(cmd).await }.boxed()
                })
                .boxed(),
            Inner::Sentinel(s) => {
                let s = s.clone();
                async move {
                    let mut con = s.connection().await.inspect_err(|e| s.lost(e))?;
                    con.req_packed_command(cmd).await.inspect_err(|e| s.lost(e))
                }
                .boxed()
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.inner {
            Inner::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Inner::Cluster(c) if !pipeline.is_transaction() => c
                .clone()
                .call(&mut self.used, move |con| {
                    cluster_pipeline(con, pipeline, offset, count).boxed()
                })
                .boxed(),
            Inner::Cluster(c) => c
                .clone()
                .call(&mut self.used, move |mut con| {
                    async move { con.req_packed_commands(pipeline, offset, count).await }.boxed()
                })
                .boxed(),
            Inner::Sentinel(s) => {
                let s = s.clone();
                async move {
                    let mut con = s.connection().await.inspect_err(|e| s.lost(e))?;
                    con.req_packed_commands(pipeline, offset, count)
                        .await
                        .inspect_err(|e| s.lost(e))
                }
                .boxed()
            }
        }
    }

    fn get_db(&self) -> i64 {
        match &self.inner {
            Inner::Single(c) => c.get_db(),
            Inner::Cluster(_) | Inner::Sentinel(_) => 0,
        }
    }
}

/// A pipeline on a Cluster. One whose keys are all in one slot goes to that slot's node as it is,
/// its commands in order (a hash and its expiry, the replay's own tagged keys). Any other is sent
/// one command at a time, all at once, each to its slot's node (redis-rs would send the whole
/// pipeline to the first command's node, where the others' keys are refused): the answers come
/// back in the pipeline's order, but commands on different nodes run in no set order, so such a
/// pipeline must not hold two commands that depend on each other's order.
async fn cluster_pipeline(
    mut con: ClusterConnection,
    pipeline: &Pipeline,
    offset: usize,
    count: usize,
) -> RedisResult<Vec<Value>> {
    let mut slots = pipeline.cmd_iter().flat_map(slots_of);
    let one_slot = match slots.next() {
        Some(first) => slots.all(|s| s == first),
        None => true,
    };
    if one_slot {
        return con.req_packed_commands(pipeline, offset, count).await;
    }
    let sent = pipeline.cmd_iter().map(|c| {
        let mut con = con.clone();
        async move { con.req_packed_command(c).await }
    });
    join_all(sent).await.into_iter().collect()
}

/// The slots of a command's keys: the keys after the key count of a script call, every argument
/// of a multi-key command, else the first argument (none for a command without arguments).
fn slots_of(cmd: &Cmd) -> Vec<u16> {
    let args: Vec<&[u8]> = cmd
        .args_iter()
        .filter_map(|a| match a {
            redis::Arg::Simple(b) => Some(b),
            _ => None,
        })
        .collect();
    let Some(name) = args.first() else {
        return Vec::new();
    };
    let name = String::from_utf8_lossy(name).to_ascii_uppercase();
    let keys: &[&[u8]] = match name.as_str() {
        "EVAL" | "EVALSHA" => {
            let n = args
                .get(2)
                .and_then(|n| std::str::from_utf8(n).ok()?.parse::<usize>().ok())
                .unwrap_or(0);
            args.get(3..3 + n).unwrap_or(&[])
        }
        "MGET" | "DEL" | "EXISTS" | "UNLINK" | "TOUCH" => &args[1..],
        "WAIT" | "INFO" | "PING" | "SCRIPT" | "CONFIG" => &[],
        _ => args.get(1..2).unwrap_or(&[]),
    };
    keys.iter()
        .map(|k| slot(&String::from_utf8_lossy(k)))
        .collect()
}

impl Redis {
    /// In a Cluster: wait until [`Redis::replicas`] replicas hold what this connection wrote
    /// under `keys` (Redis `WAIT`, on the master of each of their slots). One server and Sentinel
    /// carry their [`Redis::inline_wait`] with the write instead; nothing to do here for them, nor
    /// when no replica is asked for. An answer short of it is a lost write, for now: the caller
    /// asks again (the replica may be catching up, the failover may be under way) within its
    /// retry budget.
    pub async fn replicated(&mut self, keys: &[&str]) -> Result<(), Error> {
        let want = self.replicas;
        let Inner::Cluster(cluster) = &self.inner else {
            return Ok(());
        };
        if want == 0 || keys.is_empty() {
            return Ok(());
        }
        // `WAIT` counts the replicas holding this connection's writes: on a connection made since
        // the write it would count none of them, and say yes.
        let Some((c, gen)) = cluster.cached().filter(|(_, gen)| *gen == self.used) else {
            return Err(Error::Connection(
                "redis: the Cluster connection was made again between a write and its WAIT".into(),
            ));
        };
        let mut wait = redis::cmd("WAIT");
        wait.arg(want).arg(WAIT_MS);
        let mut slots: Vec<u16> = keys.iter().map(|k| slot(k)).collect();
        slots.sort_unstable();
        slots.dedup();
        let asked = slots.into_iter().map(|s| {
            let mut c = c.clone();
            let wait = wait.clone();
            async move {
                let to = SingleNodeRoutingInfo::SpecificNode(Route::new(s, SlotAddr::Master));
                // An error reply is the node's refusal (a replica, after a failover the slot map
                // has not caught up with), not a count: an error that `lost` acts on.
                let n = c
                    .route_command(wait, RoutingInfo::SingleNode(to))
                    .await?
                    .extract_error()?;
                redis::from_redis_value::<u64>(n).map_err(RedisError::from)
            }
        });
        let answers: RedisResult<Vec<u64>> = join_all(asked).await.into_iter().collect();
        if let Err(e) = &answers {
            cluster.lost(e, gen);
        }
        self.enough(answers?.into_iter().min().unwrap_or(want))
    }

    /// The `WAIT` to send in the same pipeline as a write, so that waiting costs no round trip of
    /// its own: with one server or Sentinel, where a pipeline goes over one connection and the
    /// `WAIT` is that write's. `None` when no replica is asked for, or in a Cluster (where the
    /// writes of a step go to several nodes: [`Redis::replicated`] asks each).
    pub fn inline_wait(&self) -> Option<Cmd> {
        if self.replicas == 0 || matches!(self.inner, Inner::Cluster(_)) {
            return None;
        }
        let mut wait = redis::cmd("WAIT");
        wait.arg(self.replicas).arg(WAIT_MS);
        Some(wait)
    }

    /// Whether `got` replicas (a `WAIT`'s answer) are enough: short of them, the write is taken as
    /// lost, for now (see [`Redis::replicated`]).
    pub fn enough(&self, got: u64) -> Result<(), Error> {
        let want = self.replicas;
        if got < want {
            return Err(Error::Connection(format!(
                "redis: a write reached {got} of the {want} replicas it must reach within {WAIT_MS} ms (replicas= in the Redis URL says how many)"
            )));
        }
        Ok(())
    }
}

/// The Cluster slot of a key: CRC16 (XMODEM) of the key, or of its `{hash tag}` when it has a
/// non-empty one, modulo 16384 (the Redis Cluster specification).
pub fn slot(key: &str) -> u16 {
    let b = key.as_bytes();
    let hashed = match b.iter().position(|&c| c == b'{') {
        Some(open) => match b[open + 1..].iter().position(|&c| c == b'}') {
            Some(len) if len > 0 => &b[open + 1..open + 1 + len],
            _ => b,
        },
        None => b,
    };
    crc16::State::<crc16::XMODEM>::calculate(hashed) % 16384
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replicas_parameter_is_taken_out_of_the_url() {
        assert_eq!(
            take_replicas("redis://h:6379/0?replicas=2").unwrap(),
            ("redis://h:6379/0".to_string(), Some(2))
        );
        assert_eq!(
            take_replicas("redis+sentinel://s:26379/m?sentinel_password=x&replicas=0").unwrap(),
            (
                "redis+sentinel://s:26379/m?sentinel_password=x".to_string(),
                Some(0)
            )
        );
        assert!(take_replicas("redis://h/?replicas=all").is_err());
    }

    #[test]
    fn a_cluster_url_names_each_node_with_the_credentials() {
        let (n, tail) = nodes("redis+cluster://u:p@a:7000,b:7001", None).unwrap();
        assert_eq!(n, ["redis://u:p@a:7000", "redis://u:p@b:7001"]);
        assert_eq!(tail, "");
        let (n, tail) = nodes("rediss+sentinel://u:p@s1:26379,s2/m/2", Some("")).unwrap();
        assert_eq!(n, ["rediss://s1:26379", "rediss://s2"]);
        assert_eq!(tail, "/m/2");
        let (n, _) = nodes("redis+sentinel://s1:26379/m", Some(":pw")).unwrap();
        assert_eq!(n, ["redis://:pw@s1:26379"]);
    }

    #[test]
    fn a_key_slot_follows_the_cluster_specification() {
        // The specification's example: CRC16 of "123456789" is 0x31C3.
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        assert_eq!(slot("a{}b"), slot("a{}b"));
        assert_ne!(slot("{}x"), slot("x"));
        assert_eq!(slot("dlq:replay:{ns/n}"), slot("dlq:settled:{ns/n}/id"));
    }

    #[test]
    fn a_pipeline_is_kept_whole_only_when_its_keys_share_a_slot() {
        let mut eval = redis::cmd("EVALSHA");
        eval.arg("sha")
            .arg(2)
            .arg("{a}1")
            .arg("{a}2")
            .arg("not a key");
        assert_eq!(slots_of(&eval), vec![slot("a"), slot("a")]);
        let mut mget = redis::cmd("MGET");
        mget.arg("x").arg("y");
        assert_eq!(slots_of(&mget), vec![slot("x"), slot("y")]);
        let mut hset = redis::cmd("HSET");
        hset.arg("h").arg("f").arg("v");
        assert_eq!(slots_of(&hset), vec![slot("h")]);
        let mut wait = redis::cmd("WAIT");
        wait.arg(1).arg(100);
        assert!(slots_of(&wait).is_empty());
    }

    #[tokio::test]
    async fn several_hosts_on_a_plain_url_say_which_scheme_they_need() {
        let e = connect("redis://a:6379,b:6379/").await.err().unwrap();
        assert!(e.to_string().contains("redis+sentinel://"), "{e}");
    }
}
