//! No URL password anywhere: each test creates a RabbitMQ user and a Redis ACL user with unique
//! passwords, runs real replays (and failing ones) through the built CLI or the operator, and
//! searches for both passwords in everything that came out: stdout and stderr (logs at `debug`
//! and `trace`), the printed resource and status, `audit` exports, the raw audit rows and state
//! in Redis, the messages themselves, and the operator's status writes, Events and logs.
//!
//! A password is searched for as written, percent-encoded, as the byte list `Debug` prints for a
//! `&[u8]` (how lapin would log a SASL PLAIN response), and, for Secrets, as the base64 of the
//! URL that holds it.
//!
//! The CLI's runs in [`commands`], the operator's in [`operator`]; the users with their passwords
//! here.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use dlq_replay::api::DlqReplay;
use dlq_replay_testkit::cluster::Cluster;
use dlq_replay_testkit::world::*;
use futures::StreamExt as _;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde_json::{json, Value};

mod commands;
mod operator;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_dlq-replay"))
}

fn hex8() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_string()
}

/// A RabbitMQ user and a Redis ACL user of one test, each with its own unique password; both
/// are deleted when this is dropped (a failing test included).
struct Users {
    amqp_user: String,
    amqp_password: String,
    redis_user: String,
    redis_password: String,
    /// Other strings that must appear nowhere (the wrong passwords a test tries).
    also: Vec<String>,
}

impl Users {
    fn create(test: &str) -> Users {
        let u = Users {
            amqp_user: format!("dlqr-{test}-{}", hex8()),
            amqp_password: format!("pw-{}", uuid::Uuid::new_v4().simple()),
            redis_user: format!("dlqr-{test}-{}", hex8()),
            redis_password: format!("rpw-{}", uuid::Uuid::new_v4().simple()),
            also: Vec::new(),
        };
        must("rabbitmqctl", &["add_user", &u.amqp_user, &u.amqp_password]);
        must(
            "rabbitmqctl",
            &["set_permissions", "-p", "/", &u.amqp_user, ".*", ".*", ".*"],
        );
        must(
            "redis-cli",
            &[
                "ACL",
                "SETUSER",
                &u.redis_user,
                "on",
                &format!(">{}", u.redis_password),
                "~*",
                "&*",
                "+@all",
            ],
        );
        u
    }

    fn amqp(&self) -> String {
        self.amqp_with(&self.amqp_password, "%2f")
    }

    fn amqp_with(&self, password: &str, vhost: &str) -> String {
        format!(
            "amqp://{}:{password}@127.0.0.1:5672/{vhost}",
            self.amqp_user
        )
    }

    fn redis(&self) -> String {
        self.redis_with(&self.redis_password, 6379)
    }

    fn redis_with(&self, password: &str, port: u16) -> String {
        format!("redis://{}:{password}@127.0.0.1:{port}/", self.redis_user)
    }

    /// A wrong password to try, which must not appear anywhere either.
    fn wrong(&mut self) -> String {
        let p = format!("wrong-{}", uuid::Uuid::new_v4().simple());
        self.also.push(p.clone());
        p
    }

    /// Panic, naming `what` and showing the line, when any form of any password is in `text`.
    fn assert_absent(&self, what: &str, text: &str) {
        let mut secrets = vec![self.amqp_password.clone(), self.redis_password.clone()];
        secrets.extend(self.also.iter().cloned());
        for secret in &secrets {
            let bytes = format!("{:?}", secret.as_bytes());
            let bytes = bytes.trim_start_matches('[').trim_end_matches(']');
            let encoded: String = url::form_urlencoded::byte_serialize(secret.as_bytes()).collect();
            for form in [secret.as_str(), bytes, encoded.as_str()] {
                if let Some(at) = text.find(form) {
                    let start = text[..at].rfind('\n').map(|i| i + 1).unwrap_or(0);
                    let end = text[at..].find('\n').map(|i| at + i).unwrap_or(text.len());
                    let line: String = text[start..end].chars().take(600).collect();
                    panic!("a password ({form}) is in {what}:\n{line}");
                }
            }
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        for url in [self.amqp(), self.redis()] {
            let encoded = b64.encode(&url);
            assert!(
                !text.contains(&encoded),
                "a Secret's URL (base64) is in {what}"
            );
        }
    }
}

impl Drop for Users {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_user", &self.amqp_user])
            .output();
        let _ = std::process::Command::new("redis-cli")
            .args(["ACL", "DELUSER", &self.redis_user])
            .output();
    }
}
