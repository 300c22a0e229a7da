//! Two machines on one: the verifier pinned to one core and every gateway to another (`taskset -c`),
//! each with one compute thread (the verifier's `--threads 1`, the gateway's `RAYON_NUM_THREADS=1`
//! for candle and rayon), so the edge and the cloud do not share a core, as they would not share a
//! machine. The benchmark process itself (client and delay proxy) is not pinned: it mostly sleeps.
//!
//! Without `taskset` or with fewer than two usable CPUs the servers run unpinned (and the report says
//! so).

use std::path::{Path, PathBuf};

use serde::Serialize;

/// Which core each side runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pinning {
    pub taskset: PathBuf,
    pub verifier_cpu: usize,
    pub gateway_cpu: usize,
}

impl Pinning {
    /// Pinning when it is wanted and possible; otherwise `None` and why not.
    pub fn decide(
        wanted: bool,
        cpus: &[usize],
        taskset: Option<PathBuf>,
    ) -> (Option<Self>, Option<String>) {
        if !wanted {
            return (
                None,
                Some("servers not pinned (--no-pin): verifier and gateway share every core".into()),
            );
        }
        let Some(taskset) = taskset else {
            return (
                None,
                Some(
                    "`taskset` not found (util-linux): servers not pinned, they share every core"
                        .into(),
                ),
            );
        };
        match cpus {
            [v, g, ..] => (Some(Self { taskset, verifier_cpu: *v, gateway_cpu: *g }), None),
            _ => (
                None,
                Some(format!("only {} usable CPU(s) ({cpus:?}): servers not pinned", cpus.len())),
            ),
        }
    }

    /// `program args…` wrapped as `taskset -c CPU program args…`.
    pub fn wrap(&self, cpu: usize, program: &Path, args: &[String]) -> (PathBuf, Vec<String>) {
        let mut wrapped = vec!["-c".to_string(), cpu.to_string(), program.display().to_string()];
        wrapped.extend(args.iter().cloned());
        (self.taskset.clone(), wrapped)
    }
}

/// The CPUs this process may run on (its affinity mask), in order.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// The first executable `name` on `PATH`.
pub fn find_in_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// The `Cpus_allowed_list` of a running process (e.g. `"1"` or `"0-1"`): proof that pinning took.
pub fn cpus_of(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|v| v.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_the_first_two_cpus_or_says_why_not() {
        let ts = Some(PathBuf::from("/usr/bin/taskset"));
        let (pin, why) = Pinning::decide(true, &[2, 5, 7], ts.clone());
        assert_eq!(pin.map(|p| (p.verifier_cpu, p.gateway_cpu)), Some((2, 5)));
        assert!(why.is_none());
        let (pin, why) = Pinning::decide(true, &[0], ts.clone());
        assert!(pin.is_none() && why.unwrap().contains("only 1 usable CPU"));
        let (pin, why) = Pinning::decide(true, &[0, 1], None);
        assert!(pin.is_none() && why.unwrap().contains("taskset"));
        let (pin, why) = Pinning::decide(false, &[0, 1], ts);
        assert!(pin.is_none() && why.unwrap().contains("--no-pin"));
    }

    #[test]
    fn wraps_a_command_in_taskset() {
        let pin = Pinning { taskset: "/usr/bin/taskset".into(), verifier_cpu: 0, gateway_cpu: 1 };
        let (program, args) =
            pin.wrap(1, Path::new("/x/spade-gateway"), &["--port".into(), "9".into()]);
        assert_eq!(program, PathBuf::from("/usr/bin/taskset"));
        assert_eq!(args, ["-c", "1", "/x/spade-gateway", "--port", "9"]);
    }

    #[test]
    fn this_process_has_cpus_and_an_affinity_list() {
        assert!(!allowed_cpus().is_empty());
        assert!(cpus_of(std::process::id()).is_some());
        assert!(find_in_path("sh").is_some());
        assert!(find_in_path("surely-no-such-program-here").is_none());
    }
}
