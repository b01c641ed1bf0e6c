//! How commands print: listings and JSON reports.

use std::path::PathBuf;

use anyhow::Context;

/// Text for a listing: one line per row, or `empty` when there are none.
pub fn lines(rows: impl IntoIterator<Item = String>, empty: &str) -> String {
    let v: Vec<String> = rows.into_iter().collect();
    if v.is_empty() {
        empty.to_string()
    } else {
        v.join("\n")
    }
}

pub fn write_json<T: serde::Serialize>(report: &T, dest: Option<PathBuf>) -> anyhow::Result<()> {
    if let Some(dest) = dest {
        let text = serde_json::to_string_pretty(report)?;
        if dest.as_os_str() == "-" {
            println!("{text}");
        } else {
            std::fs::write(&dest, text + "\n").with_context(|| format!("writing {}", dest.display()))?;
            println!("wrote {}", dest.display());
        }
    }
    Ok(())
}
