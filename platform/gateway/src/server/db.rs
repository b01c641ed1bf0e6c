//! The database: SQLite in the data directory by default (created and migrated on first
//! use), or PostgreSQL with `--database-url postgres://…` (several gateways on one
//! database). The CLI and running servers share it.

use std::path::{Path, PathBuf};

use hearth_tenants::db::DbError;
use hearth_tenants::Db;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot create data directory {dir}: {source}")]
    DataDir { dir: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Db(#[from] DbError),
}

/// `$HEARTH_DATA_DIR`, else `$XDG_DATA_HOME/hearth`, else `~/.local/share/hearth`.
pub fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("hearth");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".local").join("share").join("hearth")
}

/// Opens `database_url`, or `<data_dir>/hearth.db`.
pub async fn open(data_dir: &Path, database_url: Option<&str>) -> Result<Db, OpenError> {
    std::fs::create_dir_all(data_dir).map_err(|source| OpenError::DataDir {
        dir: data_dir.to_path_buf(),
        source,
    })?;
    let url = match database_url.filter(|u| !u.is_empty()) {
        Some(u) => u.to_string(),
        None => format!("sqlite://{}", data_dir.join("hearth.db").display()),
    };
    Ok(hearth_tenants::db::open(&url, None).await?)
}
