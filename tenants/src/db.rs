//! The SQL database every store shares: SQLite (embedded, the default) or PostgreSQL
//! (several gateways on one database). One pool type, `sqlx::AnyPool`; queries are written
//! once, in the common subset of both dialects (`$N` parameters, `ON CONFLICT`, BIGINT
//! values); the schema lives in `migrations/sqlite` and `migrations/postgres`.

use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::{AnyPool, Executor};

/// Which database a pool talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

/// A migrated pool and what it is.
#[derive(Debug, Clone)]
pub struct Db {
    pub pool: AnyPool,
    pub backend: Backend,
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("unsupported database URL {0:?}: use sqlite://PATH or postgres://…")]
    Scheme(String),
    #[error("cannot open the database: {0}")]
    Connect(#[from] sqlx::Error),
    #[error("cannot migrate the database: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

fn backend_of(url: &str) -> Result<Backend, DbError> {
    if url.starts_with("sqlite:") {
        Ok(Backend::Sqlite)
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Backend::Postgres)
    } else {
        Err(DbError::Scheme(url.split('@').next_back().unwrap_or(url).to_string()))
    }
}

/// Opens (creating a SQLite file if needed) and migrates the database at `url`.
/// `schema` (PostgreSQL only) puts every table in that schema instead of `public`.
pub async fn open(url: &str, schema: Option<&str>) -> Result<Db, DbError> {
    sqlx::any::install_default_drivers();
    let backend = backend_of(url)?;
    let memory = url.contains(":memory:") || url.contains("mode=memory");
    let mut url = url.to_string();
    if backend == Backend::Sqlite && !memory && !url.contains("mode=") {
        url.push_str(if url.contains('?') { "&mode=rwc" } else { "?mode=rwc" });
    }
    let opts = AnyConnectOptions::from_str(&url)?;
    let schema = schema.map(str::to_string);
    let pool = AnyPoolOptions::new()
        // An in-memory SQLite database exists per connection: keep exactly one.
        .max_connections(if memory { 1 } else { 16 })
        .min_connections(if memory { 1 } else { 0 })
        .idle_timeout(if memory { None } else { Some(Duration::from_secs(600)) })
        .max_lifetime(if memory { None } else { Some(Duration::from_secs(1800)) })
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            let schema = schema.clone();
            Box::pin(async move {
                match backend {
                    // WAL lets the CLI and several processes share the file; NORMAL sync
                    // keeps every commit across a process crash (not a power cut) without
                    // an fsync per commit.
                    Backend::Sqlite => {
                        conn.execute(
                            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
                             PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = ON;",
                        )
                        .await?;
                    }
                    Backend::Postgres => {
                        if let Some(s) = schema {
                            conn.execute(format!("SET search_path TO \"{s}\"").as_str()).await?;
                        }
                    }
                }
                Ok(())
            })
        })
        .connect_with(opts)
        .await?;
    match backend {
        Backend::Sqlite => sqlx::migrate!("../migrations/sqlite").run(&pool).await?,
        Backend::Postgres => sqlx::migrate!("../migrations/postgres").run(&pool).await?,
    }
    Ok(Db { pool, backend })
}

/// Test support: a fresh in-memory SQLite database, and — when `DATABASE_URL` names a
/// PostgreSQL server — a fresh schema on it, so every store test runs on both.
pub mod testing {
    use super::*;

    pub async fn sqlite() -> Db {
        open("sqlite::memory:", None).await.expect("in-memory SQLite")
    }

    /// A new, empty schema on `$DATABASE_URL` (PostgreSQL), or None when unset.
    pub async fn postgres() -> Option<Db> {
        let url = std::env::var("DATABASE_URL")
            .ok()
            .filter(|u| u.starts_with("postgres"))?;
        sqlx::any::install_default_drivers();
        let mut rnd = [0u8; 6];
        getrandom::fill(&mut rnd).expect("random");
        let now = crate::now_ms() / 1000;
        let schema = format!(
            "hearth_test_{now}_{}",
            rnd.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let admin = AnyPool::connect(&url).await.expect("DATABASE_URL is not reachable");
        // Schemas of test runs more than an hour old are dropped.
        let old: Vec<String> = sqlx::query_scalar(
            "SELECT schema_name::text FROM information_schema.schemata WHERE schema_name LIKE 'hearth_test_%'",
        )
        .fetch_all(&admin)
        .await
        .unwrap_or_default();
        for s in old {
            let born = s.split('_').nth(2).and_then(|t| t.parse::<i64>().ok()).unwrap_or(0);
            if born < now - 3600 {
                let _ = admin
                    .execute(format!("DROP SCHEMA IF EXISTS \"{s}\" CASCADE").as_str())
                    .await;
            }
        }
        admin
            .execute(format!("CREATE SCHEMA \"{schema}\"").as_str())
            .await
            .expect("create schema");
        admin.close().await;
        Some(open(&url, Some(&schema)).await.expect("migrate PostgreSQL"))
    }

    /// SQLite, then PostgreSQL when configured.
    pub async fn all() -> Vec<Db> {
        let mut v = vec![sqlite().await];
        v.extend(postgres().await);
        v
    }
}
