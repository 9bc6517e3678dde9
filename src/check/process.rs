//! The service `idem check --serve` started: its process, started again,
//! signalled, killed and read back, for the lifecycle properties
//! (`check::life`).

use super::CheckError;
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The service's process, as the check started it.
pub struct Process {
    pub(super) command: Vec<String>,
    pub(super) child: Mutex<Option<Child>>,
    pub(super) log: PathBuf,
    pub(super) address: SocketAddr,
    // the bank and the log live as long as the process
    pub(super) _dir: tempfile::TempDir,
}

impl Process {
    /// Starts the command and waits until its port takes connections; how
    /// long that took.
    pub(super) fn spawn(&self) -> Result<Duration, CheckError> {
        self.spawn_with(None)
    }

    /// [`Process::spawn`], with one more variable in its environment.
    pub(super) fn spawn_with(&self, env: Option<(&str, &str)>) -> Result<Duration, CheckError> {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(CheckError::io("the service's log"))?;
        let err = log.try_clone().map_err(CheckError::io("the service's log"))?;
        let begun = Instant::now();
        let mut command = Command::new(&self.command[0]);
        if let Some((name, value)) = env {
            command.env(name, value);
        }
        let mut child = command
            .args(&self.command[1..])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(CheckError::io(format!("cannot run {}", self.command[0])))?;
        while TcpStream::connect_timeout(&self.address, Duration::from_millis(200)).is_err() {
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || begun.elapsed() > Duration::from_secs(30) {
                let _ = child.kill();
                let _ = child.wait();
                let why = exited.map_or("did not listen within 30 s".into(), |s| format!("exited ({s})"));
                return Err(format!("--serve: the service {why}; its output ends:\n{}", self.tail()).into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        *self.child.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
        Ok(begun.elapsed())
    }

    /// Sends `signal` to the service's process group.
    #[allow(unsafe_code)] // kill(2) with SIGTERM, to a group: std's Child::kill sends SIGKILL to one
    pub(super) fn signal(&self, signal: libc::c_int) {
        if let Some(child) = self.child.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            // the group the child leads (process_group(0)): a wrapper's children too
            let group = -(child.id() as libc::pid_t);
            // SAFETY: kill(2) takes plain integers and touches no memory of ours;
            // the child is not reaped yet (we hold it), so its group id is not reused
            unsafe { libc::kill(group, signal) };
        }
    }

    /// Waits up to `limit` for the service to exit: its status, or `None`
    /// if it is still running.
    pub(super) fn exited(&self, limit: Duration) -> Option<std::process::ExitStatus> {
        let until = Instant::now() + limit;
        loop {
            let mut slot = self.child.lock().unwrap_or_else(|e| e.into_inner());
            match slot.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(status))) => {
                    *slot = None;
                    return Some(status);
                }
                None => return None,
                _ if Instant::now() > until => return None,
                _ => {}
            }
            drop(slot);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and the process reaped.
    pub(super) fn kill(&self) {
        self.signal(libc::SIGKILL);
        if let Some(mut child) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = child.wait();
        }
    }

    /// The last lines of the service's output, for an error.
    pub(super) fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(12)..].join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}
