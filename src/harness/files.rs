//! The harness's files: reports written whole or not at all, databases
//! opened only if they exist, and I/O errors that name their path.

use super::HarnessError;
use std::path::Path;

/// An I/O error that names the path it happened on: "No such file or
/// directory" alone leaves the reader guessing which file.
pub fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> HarnessError {
    HarnessError::io(path.display().to_string())
}

/// Writes `text` plus a final newline, replacing the file atomically: the
/// text goes to a temporary file of its own beside `path` (a name no other
/// writer shares), which is then renamed over it.
pub fn write_file(path: &Path, text: &str) -> Result<(), HarnessError> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io_at(dir))?;
    std::io::Write::write_all(&mut tmp, format!("{}\n", text.trim_end()).as_bytes())
        .map_err(io_at(tmp.path()))?;
    tmp.persist(path).map_err(|e| io_at(path)(e.error))?;
    Ok(())
}

/// Opens a database that must already exist (never creates an empty one).
pub fn open_existing(path: &Path) -> Result<rusqlite::Connection, HarnessError> {
    use rusqlite::OpenFlags;
    rusqlite::Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE)
        .map_err(|e| HarnessError::Stopped(format!("cannot open {}: {e}", path.display())))
}

/// Pretty JSON for the files people read.
pub fn to_json<T: serde::Serialize>(value: &T) -> Result<String, HarnessError> {
    serde_json::to_string_pretty(value).map_err(HarnessError::Json)
}
