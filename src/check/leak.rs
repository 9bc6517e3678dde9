//! What an error answer must never show: the service's internals. A body
//! or header value that names a file by its absolute path, carries a
//! connection string, or holds a stack frame tells an attacker where the
//! data lives and what runs it (draft §6), whatever the language.

/// Words only internals use: stack traces of the usual runtimes, SQL,
/// database drivers, connection strings.
const MARKERS: [&str; 27] = [
    "Traceback",
    "Exception",
    "exception",
    "File \"/",
    "\", line ",
    "panicked",
    "stack backtrace",
    "goroutine ",
    "node_modules",
    "at Object.",
    "\tat ",
    "SELECT ",
    "INSERT ",
    "UPDATE ",
    "sqlite",
    "psycopg",
    "postgres",
    "mysql://",
    "mongodb://",
    "redis://",
    "host=",
    "dbname=",
    "password=",
    "sslmode=",
    "Data Source=",
    "jdbc:",
    "Server=",
];

/// The first directories of absolute filesystem paths (Unix, macOS).
const ROOTS: [&str; 21] = [
    "home", "root", "tmp", "var", "usr", "etc", "opt", "srv", "mnt", "proc", "run", "dev", "lib", "bin",
    "sys", "Users", "private", "Volumes", "nix", "app", "work",
];

/// Extensions that name source or data files, not resources.
const FILES: [&str; 14] = [
    ".db", ".sqlite", ".sqlite3", ".py", ".rs", ".js", ".mjs", ".ts", ".go", ".java", ".rb", ".php", ".sock",
    ".log",
];

/// The internal `text` shows, if any: a marker, an absolute path, or a
/// source line (`main.rs:12`).
pub fn leak(text: &str) -> Option<String> {
    if let Some(m) = MARKERS.iter().find(|m| text.contains(**m)) {
        return Some((*m).to_owned());
    }
    let words = text.split(|c: char| c.is_whitespace() || "\"'=(),;[]{}<>`".contains(c));
    words.filter(|w| !w.is_empty()).find(|w| path(w) || windows_path(w) || source_line(w)).map(str::to_owned)
}

/// `/home/app/bank.db`, `/srv/x`: an absolute path under a filesystem root,
/// or of two parts or more naming a source or data file. An API path
/// (`/v1/transfers/7`) is neither.
fn path(word: &str) -> bool {
    let Some(rest) = word.strip_prefix('/') else { return false };
    let mut parts = rest.split('/');
    let first = parts.next().unwrap_or_default();
    let more = parts.next().is_some();
    let file = FILES.iter().any(|e| word.to_ascii_lowercase().ends_with(e));
    more && (ROOTS.contains(&first) || file)
}

/// `C:\data\bank.db`.
fn windows_path(word: &str) -> bool {
    let b = word.as_bytes();
    b.len() > 3 && b[0].is_ascii_alphabetic() && b[1] == b':' && b[2] == b'\\'
}

/// `src/main.rs:12:5`, `app.js:40`: a source file and a line.
fn source_line(word: &str) -> bool {
    FILES.iter().filter(|e| !matches!(**e, ".db" | ".sqlite" | ".sqlite3" | ".sock" | ".log")).any(|e| {
        word.find(&format!("{e}:"))
            .is_some_and(|at| word[at + e.len() + 1..].chars().next().is_some_and(|c| c.is_ascii_digit()))
    })
}

#[cfg(test)]
mod tests {
    use super::leak;

    #[test]
    fn internals_are_found_in_any_runtime_s_spelling() {
        for text in [
            r#"{"detail": "no such table (database /tmp/.tmpAbC/bank.db)"}"#,
            r#"{"detail": "open C:\\data\\bank.db failed"}"#,
            "could not connect: host=10.0.0.5 port=5432 dbname=bank",
            "postgresql://app:secret@db:5432/bank",
            "thread 'main' panicked at src/main.rs:12:5",
            "Error\n    at handler (/srv/app/server.js:40:11)",
            "TypeError: x is undefined at server.mjs:40",
            "  File \"/srv/app.py\", line 12",
            "java.lang.NullPointerException\n\tat com.shop.Pay.run(Pay.java:9)",
            "/home/shop/data",
        ] {
            assert!(leak(text).is_some(), "{text}");
        }
    }

    #[test]
    fn what_a_correct_error_shows_is_no_leak() {
        for text in [
            r#"{"type": "https://idem.example/problems/in-progress", "title": "in_progress", "status": 409, "instance": "/v1/transfers"}"#,
            r#"{"reason": "unknown_account", "status": 404}"#,
            "/v1/transfers/7",
            "/openapi.json",
            "application/problem+json",
            "Sat, 05 Dec 2026 11:57:33 GMT",
            "BaseHTTP/0.6 Python/3.12.3",
            "the amount must be an integer from 1 to 9007199254740991",
        ] {
            assert_eq!(leak(text), None, "{text}");
        }
    }
}
