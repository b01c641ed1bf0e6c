//! The Hearth processes a benchmark starts (workers, gateways), and its admin CLI.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed on drop.
pub(crate) struct Proc(pub(crate) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `hearth ARGS` with `env` and waits for its "listening on http://ADDR" line.
pub(crate) fn spawn(exe: &Path, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<(Proc, String)> {
    let mut child = Command::new(exe)
        .args(args)
        .envs(env.iter().copied())
        .env("HEARTH_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let proc = Proc(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| anyhow::anyhow!("hearth {args:?} did not start"))?;
        if let Some(rest) = line.split("listening on ").nth(1) {
            let url = rest.split_whitespace().next().unwrap_or_default().to_string();
            std::thread::spawn(move || while rx.recv().is_ok() {});
            return Ok((proc, url));
        }
    }
}

/// A new API key of `tenant` (which must exist), made with `hearth admin key create`.
pub(crate) fn new_key(exe: &Path, data: &str, tenant: &str) -> anyhow::Result<String> {
    let out = cli(exe, "admin", data, &["key", "create", "--tenant", tenant])?;
    out.split_whitespace()
        .find(|w| w.starts_with("hk_"))
        .map(str::to_string)
        .ok_or_else(|| anyhow::anyhow!("no key printed"))
}

/// `hearth CMD --data-dir DATA ARGS` (CMD: `admin`, `processor`), its output.
pub(crate) fn cli(exe: &Path, cmd: &str, data: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(exe).args([cmd, "--data-dir", data]).args(args).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
