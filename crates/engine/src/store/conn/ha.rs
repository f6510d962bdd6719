//! The two forms of Redis whose master can change under the replay: a Sentinel group and a
//! Redis Cluster. Each keeps its connection and makes it again once it failed.

use std::sync::{Arc, Mutex};

use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{IntoConnectionInfo, RedisError, RedisResult};

use super::{bad_url, cannot_connect, nodes, TIMEOUT};
use crate::Error;

/// A Redis Cluster: the connection to it, made again (from the URL's nodes) once it failed with
/// a lost connection or a timeout. redis-rs repairs its cluster connection in the background
/// after a node is lost, but a repair that began while the killed master was still listed can
/// leave every later call timing out (seen: two minutes of 5 s timeouts after a master's
/// `kill -9`, until the pass gave up and left its claims `OutcomeUnknown`); a new connection
/// asks the nodes that are left for the slots.
pub(crate) struct Cluster {
    client: redis::cluster::ClusterClient,
    making: tokio::sync::Mutex<()>,
    /// The connection, and its generation (one more each time it is made).
    current: Mutex<(Option<ClusterConnection>, u64)>,
}

impl Cluster {
    pub(super) async fn new(url: &str) -> Result<Arc<Self>, Error> {
        let (nodes, _) = nodes(url, None)?;
        let mut infos = Vec::new();
        for n in &nodes {
            infos.push(n.as_str().into_connection_info().map_err(bad_url)?);
        }
        let client = redis::cluster::ClusterClientBuilder::new(infos)
            .connection_timeout(TIMEOUT)
            .response_timeout(TIMEOUT)
            .build()
            .map_err(bad_url)?;
        let me = Arc::new(Self {
            client,
            making: tokio::sync::Mutex::new(()),
            current: Mutex::new((None, 0)),
        });
        me.connection().await.map_err(cannot_connect)?;
        Ok(me)
    }

    /// The connection and its generation, made if there is none.
    pub(super) async fn connection(&self) -> RedisResult<(ClusterConnection, u64)> {
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let _making = self.making.lock().await;
        // Another call may have made it while this one waited for the lock.
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let con = self.client.get_async_connection().await?;
        let mut current = self.current.lock().map_err(|_| poisoned())?;
        current.1 += 1;
        current.0 = Some(con.clone());
        Ok((con, current.1))
    }

    pub(super) fn cached(&self) -> Option<(ClusterConnection, u64)> {
        let current = self.current.lock().ok()?;
        current.0.clone().map(|c| (c, current.1))
    }

    /// After an error on the connection of generation `gen`: a lost connection or a timeout
    /// makes the next call make a new one (unless one was made since).
    pub(super) fn lost(&self, e: &RedisError, gen: u64) {
        if !crate::redis_connection_lost(e) {
            return;
        }
        if let Ok(mut current) = self.current.lock() {
            if current.1 == gen && current.0.is_some() {
                tracing::warn!(error = %e, "a Redis Cluster call failed; the next one makes a new connection to the cluster");
                current.0 = None;
            }
        }
    }

    /// A call over the connection: which generation it used, and its answer.
    pub(super) async fn call<'a, T>(
        self: Arc<Self>,
        used: &'a mut u64,
        f: impl FnOnce(ClusterConnection) -> futures::future::BoxFuture<'a, RedisResult<T>>,
    ) -> RedisResult<T> {
        let (con, gen) = self.connection().await?;
        *used = gen;
        let answer = f(con).await;
        if let Err(e) = &answer {
            self.lost(e, gen);
        }
        answer
    }
}

fn poisoned() -> RedisError {
    RedisError::from((
        redis::ErrorKind::Client,
        "the Redis Cluster connection's lock was poisoned",
    ))
}

/// The master of a Sentinel group: the connection to it, made again (after asking the sentinels)
/// once it failed with a lost connection or a read-only master.
pub(crate) struct Sentinel {
    client: tokio::sync::Mutex<SentinelClient>,
    /// The connection to the master.
    current: Mutex<Option<MultiplexedConnection>>,
}

impl Sentinel {
    pub(super) async fn new(url: &str) -> Result<Arc<Self>, Error> {
        // The master's credentials are the URL's; the sentinels get none unless the query gives
        // them theirs.
        let (with_master_auth, tail) = nodes(url, None)?;
        let (bare, _) = nodes(url, Some(""))?;
        let query: std::collections::HashMap<String, String> =
            url::form_urlencoded::parse(tail.split_once('?').map_or("", |(_, q)| q).as_bytes())
                .into_owned()
                .collect();
        let mut sentinels = Vec::new();
        for s in &bare {
            let mut u = url::Url::parse(s).map_err(|e| Error::Config(format!("Redis URL: {e}")))?;
            let (user, pass) = (
                query.get("sentinel_username"),
                query.get("sentinel_password"),
            );
            if user.is_some() || pass.is_some() {
                let auth = u
                    .set_username(user.map_or("", String::as_str))
                    .and_then(|()| u.set_password(pass.map(String::as_str)));
                auth.map_err(|()| Error::Config("Redis URL: bad sentinel credentials".into()))?;
            }
            sentinels.push(u.to_string());
        }
        let path = tail.split(['?', '#']).next().unwrap_or("");
        let mut segments = path.trim_start_matches('/').split('/');
        let master = segments.next().filter(|m| !m.is_empty()).ok_or_else(|| {
            Error::Config(
                "Redis URL: redis+sentinel:// needs the master's name as its path (redis+sentinel://s1:26379,s2:26379/mymaster)".into(),
            )
        })?;
        // The master's own credentials and database, as a one-server URL would give them.
        let db = segments.next().filter(|d| !d.is_empty()).unwrap_or("0");
        let first = with_master_auth.first().map(String::as_str).unwrap_or("");
        let master_info = format!("{first}/{db}")
            .as_str()
            .into_connection_info()
            .map_err(bad_url)?;
        let mut node = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(master_info.redis_settings().clone());
        if url.starts_with("rediss") {
            node = node.set_tls_mode(redis::TlsMode::Secure);
        }
        let mut infos = Vec::new();
        for s in &sentinels {
            infos.push(s.as_str().into_connection_info().map_err(bad_url)?);
        }
        let client = SentinelClient::build(infos, master, Some(node), SentinelServerType::Master)
            .map_err(bad_url)?;
        let me = Arc::new(Self {
            client: tokio::sync::Mutex::new(client),
            current: Mutex::new(None),
        });
        me.connection().await.map_err(cannot_connect)?;
        Ok(me)
    }

    /// The connection to the master, made (the sentinels asked which it is) if there is none.
    pub(super) async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let mut client = self.client.lock().await;
        // Another call may have made it while this one waited for the lock.
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(TIMEOUT))
            .set_connection_timeout(Some(TIMEOUT));
        let con = client.get_async_connection_with_config(&config).await?;
        if let Ok(mut current) = self.current.lock() {
            *current = Some(con.clone());
        }
        Ok(con)
    }

    fn cached(&self) -> Option<MultiplexedConnection> {
        self.current.lock().ok().and_then(|c| c.clone())
    }

    /// After an error: a lost connection or a master that is no more makes the next call ask
    /// the sentinels again.
    pub(super) fn lost(&self, e: &RedisError) {
        if crate::redis_connection_lost(e) {
            tracing::warn!(error = %e, "the Redis master is lost; asking the sentinels for the master again");
            if let Ok(mut current) = self.current.lock() {
                *current = None;
            }
        }
    }
}
