//! `amqps://` and `rediss://` for real: a CA and a server certificate made with the `openssl`
//! CLI at test time, a dedicated TLS-only `redis-server` (`--port 0 --tls-port N`), and `socat`
//! terminating TLS in front of the local RabbitMQ. The built CLI replays through both with the
//! CA given by `SSL_CERT_FILE`; without it the certificate is untrusted and the run fails with
//! an error that says so (and does not repeat the URL's password).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use dlq_replay_testkit::world::*;
use serde_json::json;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_dlq-replay"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Run the `openssl` CLI in `dir` with `args` (split at spaces).
fn openssl(dir: &Path, args: &str) {
    let out = Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .output()
        .expect("openssl CLI");
    assert!(
        out.status.success(),
        "openssl {args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`ca.pem`) and a server certificate it signed (`server.pem`, `server.key`) for
/// `localhost` and `127.0.0.1`.
fn certificates(dir: &Path) {
    openssl(
        dir,
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=dlq-replay-test-CA",
    );
    openssl(
        dir,
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .expect("write server.ext");
    openssl(
        dir,
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile server.ext",
    );
}

/// A child process killed (by its pid) when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `spawn(port)` on a free port and wait until it accepts connections; a new port when
/// it exits at once (someone took the port in between).
fn start(name: &'static str, spawn: impl Fn(u16) -> Child) -> Server {
    for _ in 0..5 {
        let port = free_port();
        let mut server = Server {
            child: spawn(port),
            port,
        };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = server.child.try_wait() {
                break;
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = server.child.kill();
    }
    panic!("{name} never listened");
}

/// The TLS endpoints of one test: a TLS-only Redis (with a password) and a TLS terminator for
/// RabbitMQ.
struct Tls {
    dir: tempfile::TempDir,
    redis: Server,
    redis_password: String,
    amqp: Server,
}

impl Tls {
    fn start() -> Tls {
        let dir = tempfile::tempdir().expect("tempdir");
        certificates(dir.path());
        let path = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
        let (cert, key, ca) = (path("server.pem"), path("server.key"), path("ca.pem"));
        let redis_password = format!("rpw-{}", uuid::Uuid::new_v4().simple());
        let redis = start("redis-server --tls-port", |port| {
            Command::new("redis-server")
                .args(["--port", "0", "--bind", "127.0.0.1"])
                .args(["--tls-port", &port.to_string()])
                .args(["--tls-cert-file", &cert, "--tls-key-file", &key])
                .args(["--tls-ca-cert-file", &ca, "--tls-auth-clients", "no"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--requirepass", &redis_password])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server")
        });
        let amqp = start("socat OPENSSL-LISTEN", |port| {
            Command::new("socat")
                .arg(format!(
                    "OPENSSL-LISTEN:{port},bind=127.0.0.1,cert={cert},key={key},verify=0,reuseaddr,fork"
                ))
                .arg("TCP:127.0.0.1:5672")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("socat")
        });
        Tls {
            dir,
            redis,
            redis_password,
            amqp,
        }
    }

    fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The broker through the TLS terminator, by host name.
    fn amqps(&self, password: &str) -> String {
        format!("amqps://guest:{password}@localhost:{}/%2f", self.amqp.port)
    }

    /// The TLS-only Redis, by IP address.
    fn rediss(&self) -> String {
        format!(
            "rediss://:{}@127.0.0.1:{}/",
            self.redis_password, self.redis.port
        )
    }

    /// The manifest of `w` with the broker at `amqp` and the audit trail and claims at `redis`,
    /// written into this test's directory.
    fn manifest(&self, w: &World, amqp: &str, redis: &str) -> PathBuf {
        let mut resource = w.manifest(&format!(
            "  audit: {{redis: {{url: \"{redis}\"}}}}\n{}",
            w.idempotency("Claim")
        ));
        resource.spec.broker.url = Some(amqp.into());
        let file = self.dir.path().join(format!("{}.yaml", w.tag));
        std::fs::write(&file, serde_yaml::to_string(&resource).expect("yaml")).expect("write");
        file
    }
}

/// The CLI with no stand-in URLs from this process's environment, and with `SSL_CERT_FILE`
/// set to `ca` or, without one, no CA from the environment at all.
fn cli(args: &[&str], file: &Path, ca: Option<&Path>) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .arg("-f")
        .arg(file)
        .env_remove("AMQP_URL")
        .env_remove("REDIS_URL")
        .env_remove("SSL_CERT_DIR")
        .env_remove("SSL_CERT_FILE");
    if let Some(ca) = ca {
        cmd.env("SSL_CERT_FILE", ca);
    }
    cmd.output().expect("run the CLI")
}

#[tokio::test]
async fn amqps_and_rediss_replay_end_to_end_with_the_ca_from_ssl_cert_file() {
    let tls = Tls::start();
    let w = World::new("tls").await;
    w.dead_letter((0..20).map(|i| job(&format!("t{i}"), json!({}))).collect())
        .await;
    let file = tls.manifest(&w, &tls.amqps("guest"), &tls.rediss());

    let out = cli(
        &["run", "--no-progress", "-o", "json"],
        &file,
        Some(&tls.ca()),
    );
    assert!(out.status.success(), "{}", output_text(&out));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let status = &printed["status"];
    assert_eq!(status["phase"], "Done", "{}", output_text(&out));
    assert_eq!(status["counts"]["replayed"], 20, "{}", output_text(&out));
    assert_eq!(status["audit"]["records"], 20, "{}", output_text(&out));
    let target = w.take(&w.topo.work).await;
    assert_eq!(target.len(), 20);
    assert_each_key_once(&target);
    assert_eq!(w.depth(&w.topo.dlq).await, 0);
    // The claims went to the TLS Redis, not to the local one.
    assert_eq!(w.get(&w.key("t0")).await, None);

    // The audit trail, read back from the TLS-only Redis.
    let audit = cli(&["audit"], &file, Some(&tls.ca()));
    assert!(audit.status.success(), "{}", output_text(&audit));
    let rows = String::from_utf8_lossy(&audit.stdout);
    assert_eq!(rows.lines().count(), 20, "{}", output_text(&audit));
    assert!(rows.lines().all(|l| l.contains("\"replayed\"")), "{rows}");
    w.cleanup().await;
}

#[tokio::test]
async fn an_untrusted_certificate_fails_with_a_tls_error_that_hides_the_password() {
    let tls = Tls::start();
    let w = World::new("tls-untrusted").await;
    w.dead_letter(vec![job("u0", json!({}))]).await;
    let password = format!("pw-{}", uuid::Uuid::new_v4().simple());

    // The broker's certificate is checked first: no SSL_CERT_FILE, so its CA is unknown.
    let file = tls.manifest(&w, &tls.amqps(&password), &tls.rediss());
    for args in [&["run", "--no-progress"][..], &["plan"][..]] {
        let out = cli(args, &file, None);
        let all = output_text(&out);
        assert!(!out.status.success(), "{all}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("{args:?} without the CA:\n{stderr}");
        assert!(
            stderr.contains("error: broker: cannot connect")
                && stderr.contains("invalid peer certificate")
                && stderr.contains("TLS")
                && stderr.contains("SSL_CERT_FILE"),
            "{all}"
        );
        assert!(!all.contains(&password), "the password leaked: {all}");
        assert!(
            !all.contains(&tls.redis_password),
            "the password leaked: {all}"
        );
    }

    // Redis: the broker is the plain local one, Redis the TLS one with an untrusted certificate.
    let file = tls.manifest(&w, AMQP, &tls.rediss());
    let out = cli(&["run", "--no-progress"], &file, None);
    let all = output_text(&out);
    assert!(!out.status.success(), "{all}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("rediss without the CA:\n{stderr}");
    assert!(
        stderr.contains("error: redis: cannot connect")
            && stderr.contains("certificate")
            && stderr.contains("TLS")
            && stderr.contains("SSL_CERT_FILE"),
        "{all}"
    );
    assert!(
        !all.contains(&tls.redis_password),
        "the password leaked: {all}"
    );
    // Nothing was touched.
    assert_eq!(w.depth(&w.topo.dlq).await, 1);

    // With the CA the same manifests work (the failure above was the certificate, nothing else).
    let out = cli(&["run", "--no-progress"], &file, Some(&tls.ca()));
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(w.take(&w.topo.work).await.len(), 1);
    w.cleanup().await;
}
