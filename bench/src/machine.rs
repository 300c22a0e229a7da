//! What the benchmark reads about the machine: a process's CPU time (the verifier's CPU seconds are
//! the cloud's cost), the machine's description for the report, and a UTC timestamp for the results
//! folder (no date crate is in the workspace, and this is all the calendar arithmetic needed), and
//! the commit a run measured.

use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// User + system CPU seconds a process has used so far, all its threads together.
pub fn cpu_seconds(pid: u32) -> io::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let ticks = cpu_ticks(&stat).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidData, format!("unexpected /proc/{pid}/stat"))
    })?;
    // SAFETY: sysconf only reads a configuration value.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Ok(ticks as f64 / if per_second > 0 { per_second as f64 } else { 100.0 })
}

/// A process's resident memory now (`VmRSS`), in MiB; 0 when it cannot be read.
pub fn rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok());
    kb.map_or(0.0, |kb| kb / 1024.0)
}

/// utime + stime (fields 14 and 15) of a `/proc/PID/stat` line. The command name (field 2) is in
/// parentheses and may itself hold spaces or parentheses, so fields are counted after the last ')'.
pub fn cpu_ticks(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state): field n is at index n - 3.
    let utime: u64 = fields.get(14 - 3)?.parse().ok()?;
    let stime: u64 = fields.get(15 - 3)?.parse().ok()?;
    Some(utime + stime)
}

/// The machine a run was measured on, as the report states it.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    pub kernel: String,
}

impl Machine {
    pub fn describe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Self {
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model: field(&cpuinfo, "model name").unwrap_or_else(|| "unknown".into()),
            memory_gib: field(&meminfo, "MemTotal")
                .and_then(|kb| kb.trim_end_matches("kB").trim().parse::<f64>().ok())
                .map_or(0.0, |kb| kb / (1024.0 * 1024.0)),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map_or_else(|_| "unknown".into(), |s| s.trim().to_string()),
        }
    }
}

/// The value of the first `key : value` line of a /proc text file.
fn field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// Now as `YYYYMMDDTHHMMSSZ`.
pub fn utc_stamp() -> String {
    stamp(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()))
}

/// Seconds since the Unix epoch as `YYYYMMDDTHHMMSSZ` (proleptic Gregorian, Howard Hinnant's
/// days-to-civil algorithm).
pub fn stamp(unix_seconds: u64) -> String {
    let days = (unix_seconds / 86_400) as i64;
    let secs = unix_seconds % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The commit measured, and whether the working tree differed from it.
pub fn git_state() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match (
        git(&["rev-parse", "--short", "HEAD"]),
        git(&["status", "--porcelain", "--untracked-files=no"]),
    ) {
        (Some(head), Some(changes)) if !changes.is_empty() => {
            format!("git {head} with uncommitted changes")
        }
        (Some(head), _) => format!("git {head}"),
        _ => "unknown (not a git checkout)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_counts_fields_after_the_command_name() {
        let stat = "4242 (spade (ver) x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 8729 550 0 0 20 0 5 0 100 1000 300";
        assert_eq!(cpu_ticks(stat), Some(8729 + 550));
        assert_eq!(cpu_ticks("4242 (short) S 1"), None);
        assert_eq!(cpu_ticks("no parenthesis"), None);
    }

    #[test]
    fn own_process_has_cpu_time() {
        assert!(cpu_seconds(std::process::id()).unwrap() >= 0.0);
    }

    #[test]
    fn stamps_known_dates() {
        assert_eq!(stamp(0), "19700101T000000Z");
        assert_eq!(stamp(951_782_400), "20000229T000000Z");
        assert_eq!(stamp(1_798_539_045), "20261229T101045Z");
    }

    #[test]
    fn reads_proc_style_fields() {
        assert_eq!(
            field("processor\t: 0\nmodel name\t: AMD EPYC\n", "model name").as_deref(),
            Some("AMD EPYC")
        );
        assert_eq!(
            field("MemTotal:       24683620 kB\n", "MemTotal").as_deref(),
            Some("24683620 kB")
        );
        assert_eq!(field("", "x"), None);
    }
}
