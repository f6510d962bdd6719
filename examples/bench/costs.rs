//! What a run cost: its wall time, peak RSS and CPU (/proc, /usr/bin/time), Redis's own counters
//! (INFO cpu, INFO commandstats) and the allocations a count-allocs build reports.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use dlq_replay::engine::store::Redis;

use crate::counters::Published;
use crate::footprint::{info_field, redis_info, Footprint};

/// What one timed run measured.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub(crate) n: usize,
    pub(crate) wall: f64,
    /// Peak RSS of dlq-replay in KiB (none for Shovel).
    pub(crate) rss_kib: Option<u64>,
    /// CPU seconds of dlq-replay (user + sys); none for Shovel.
    pub(crate) cpu: Option<(f64, f64)>,
    /// CPU seconds spent during the run, by the broker, Redis, this harness and the machine.
    pub(crate) usage: Usage,
    /// The replay's keys in Redis (with `Extras::footprint`).
    pub(crate) footprint: Option<Footprint>,
    /// Messages replayed (published to the target): n for Shovel and the bare client.
    pub(crate) replayed: u64,
    /// Redis over the run, from its own INFO: CPU seconds (used_cpu_user + used_cpu_sys) and
    /// commands executed (INFO commandstats, scripts' inner calls included, INFO itself not).
    pub(crate) redis_info: RedisDelta,
    /// Allocations of the process (a binary built with `--features count-allocs` prints them
    /// at exit), none otherwise.
    pub(crate) allocs: Option<u64>,
    /// What a `dlq-replay run` ended with (none for Shovel and the bare client).
    pub(crate) outcome: Option<Outcome>,
}

/// What a `dlq-replay run` ended with, beyond its timings.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// The final `status` it printed.
    pub(crate) status: serde_json::Value,
    /// When it was spawned (wall clock), to place the status's timestamps in the run.
    pub(crate) spawned: chrono::DateTime<chrono::Utc>,
    /// What the broker counted (with `Extras::publishes`).
    pub(crate) published: Option<Published>,
}

/// Redis's own counters over a run (INFO cpu, INFO commandstats).
#[derive(Debug, Clone, Default)]
pub(crate) struct RedisDelta {
    pub(crate) cpu: f64,
    pub(crate) calls: u64,
    /// Calls per command, largest first.
    pub(crate) by_command: Vec<(String, u64)>,
}

/// Redis's counters now: CPU seconds and calls per command (INFO's own calls left out).
pub(crate) async fn redis_counters(
    con: &mut Redis,
) -> (f64, std::collections::BTreeMap<String, u64>) {
    let cpu_info = redis_info(con, "cpu").await;
    let f = |n: &str| {
        info_field(&cpu_info, n)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let cpu = f("used_cpu_user") + f("used_cpu_sys");
    let stats = redis_info(con, "commandstats").await;
    let mut calls = std::collections::BTreeMap::new();
    for line in stats.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        if name == "info" {
            continue;
        }
        let n = rest
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        calls.insert(name.to_string(), n);
    }
    (cpu, calls)
}

pub(crate) fn redis_delta(
    before: &(f64, std::collections::BTreeMap<String, u64>),
    after: &(f64, std::collections::BTreeMap<String, u64>),
) -> RedisDelta {
    let mut by_command: Vec<(String, u64)> = after
        .1
        .iter()
        .map(|(k, v)| (k.clone(), v.saturating_sub(*before.1.get(k).unwrap_or(&0))))
        .filter(|(_, v)| *v > 0)
        .collect();
    by_command.sort_by_key(|c| std::cmp::Reverse(c.1));
    RedisDelta {
        cpu: (after.0 - before.0).max(0.0),
        calls: by_command.iter().map(|(_, v)| v).sum(),
        by_command,
    }
}

/// The allocation count a `count-allocs` build prints at exit, from its stderr.
pub(crate) fn parse_allocs(stderr: &[u8]) -> Option<u64> {
    String::from_utf8_lossy(stderr).lines().find_map(|l| {
        l.strip_prefix("count-allocs: allocations=")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// CPU seconds so far (a snapshot) or over a run (a difference of two).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    pub(crate) broker: f64,
    pub(crate) redis: f64,
    pub(crate) harness: f64,
    /// All cores, every process: user + nice + system + irq + softirq + steal.
    pub(crate) busy: f64,
    pub(crate) iowait: f64,
}

impl std::ops::Sub for Usage {
    type Output = Usage;
    fn sub(self, o: Usage) -> Usage {
        Usage {
            broker: self.broker - o.broker,
            redis: self.redis - o.redis,
            harness: self.harness - o.harness,
            busy: self.busy - o.busy,
            iowait: self.iowait - o.iowait,
        }
    }
}

impl Run {
    /// CPU microseconds per DLQ message of the process measured (dlq-replay, or this harness
    /// for the bare client), none for Shovel (it runs inside the broker).
    pub(crate) fn own_us(&self) -> Option<f64> {
        self.cpu.map(|(u, s)| (u + s) * 1e6 / self.n as f64)
    }

    pub(crate) fn broker_us(&self) -> f64 {
        self.usage.broker * 1e6 / self.n as f64
    }

    /// Redis CPU per DLQ message, from Redis's INFO cpu.
    pub(crate) fn redis_us(&self) -> f64 {
        self.redis_info.cpu * 1e6 / self.n as f64
    }

    /// Redis commands per replayed message.
    pub(crate) fn redis_calls(&self) -> f64 {
        self.redis_info.calls as f64 / self.replayed.max(1) as f64
    }

    pub(crate) fn allocs_per(&self) -> Option<f64> {
        self.allocs.map(|a| a as f64 / self.replayed.max(1) as f64)
    }

    pub(crate) fn cost_text(&self) -> String {
        let top: Vec<String> = self
            .redis_info
            .by_command
            .iter()
            .take(8)
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        format!(
            "per message: own {} us, broker {:.1} us, Redis {:.1} us CPU; Redis {:.2} commands per replayed message ({}){}",
            self.own_us().map(|u| format!("{u:.1}")).unwrap_or_else(|| "-".into()),
            self.broker_us(),
            self.redis_us(),
            self.redis_calls(),
            top.join(", "),
            self.allocs_per()
                .map(|a| format!("; {a:.1} allocations per replayed message ({} in all)", self.allocs.unwrap_or(0)))
                .unwrap_or_default()
        )
    }

    pub(crate) fn rate(&self) -> f64 {
        self.n as f64 / self.wall
    }

    /// CPU seconds of processes other than dlq-replay, the broker, Redis and this harness
    /// (another build or test suite on the machine makes the figures noisy).
    pub(crate) fn other(&self) -> f64 {
        let own = self.cpu.map(|(u, s)| u + s).unwrap_or(0.0);
        let u = &self.usage;
        (u.busy - u.broker - u.redis - u.harness - own).max(0.0)
    }

    pub(crate) fn machine_text(&self) -> String {
        format!(
            "machine {:.2} of {} cores busy, other processes {:.2} CPU/s, iowait {:.2}",
            self.usage.busy / self.wall,
            nproc(),
            self.other() / self.wall,
            self.usage.iowait / self.wall
        )
    }
}

pub(crate) fn rss_text(kib: Option<u64>) -> String {
    kib.map(|k| format!("{:.1} MiB", k as f64 / 1024.0))
        .unwrap_or_else(|| "n/a".into())
}

/// `%M %U %S` as written by /usr/bin/time: peak RSS (KiB), user and system seconds.
pub(crate) fn parse_time(text: &str) -> (Option<u64>, Option<(f64, f64)>) {
    // A child killed by a signal makes time write a "Command terminated" line first.
    let line = text.lines().last().unwrap_or("");
    let f: Vec<&str> = line.split_whitespace().collect();
    let rss = f.first().and_then(|v| v.parse().ok());
    let cpu = match (
        f.get(1).and_then(|v| v.parse().ok()),
        f.get(2).and_then(|v| v.parse().ok()),
    ) {
        (Some(u), Some(s)) => Some((u, s)),
        _ => None,
    };
    (rss, cpu)
}

/// Does `/usr/bin/time -f %M -o file` report a peak RSS here?
pub(crate) fn time_works(dir: &Path) -> bool {
    let out = dir.join("probe.time");
    let ok = std::process::Command::new("/usr/bin/time")
        .arg("-f")
        .arg("%M %U %S")
        .arg("-o")
        .arg(&out)
        .arg("true")
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ok && parse_time(&std::fs::read_to_string(&out).unwrap_or_default())
        .0
        .is_some_and(|k| k > 0)
}

/// The last VmHWM (KiB) seen in /proc/<pid>/status before the process went away.
pub(crate) async fn poll_hwm(pid: u32) -> Option<u64> {
    let mut last = None;
    loop {
        let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return last;
        };
        let hwm = s
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok());
        match hwm {
            Some(h) => last = Some(h),
            None => return last, // a zombie has no memory lines
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Busy and iowait clock ticks of all cores, from the first line of /proc/stat.
pub(crate) fn machine_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let get = |i: usize| f.get(i).copied().unwrap_or(0.0);
    // user nice system idle iowait irq softirq steal (guest time is inside user already)
    (get(0) + get(1) + get(2) + get(5) + get(6) + get(7), get(4))
}

/// utime and stime of a process, in clock ticks.
pub(crate) fn proc_cpu_split(pid: u32) -> (f64, f64) {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return (0.0, 0.0);
    };
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm: state is field 3, utime 14 and stime 15 (1-based over the whole line).
    let get = |i: usize| {
        f.get(i - 3)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (get(14), get(15))
}

/// utime + stime of a process, in clock ticks.
pub(crate) fn proc_cpu(pid: u32) -> f64 {
    let (user, sys) = proc_cpu_split(pid);
    user + sys
}

/// The longest-running process of that name (the server, not a CLI's own VM).
pub(crate) fn oldest_process(comm: &str) -> Option<u32> {
    let mut best: Option<(u64, u32)> = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .map(|c| c.trim() != comm)
            .unwrap_or(true)
        {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let start: u64 = rest
            .split_whitespace()
            .nth(22 - 3)
            .and_then(|v| v.parse().ok())
            .unwrap_or(u64::MAX);
        if best.is_none_or(|(s, _)| start < s) {
            best = Some((start, pid));
        }
    }
    best.map(|(_, p)| p)
}

pub(crate) fn nproc() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0)
}

pub(crate) fn cmd_out(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}
