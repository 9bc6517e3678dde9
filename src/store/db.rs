//! Which database `--db` names, parsed once: a SQLite file, or a
//! PostgreSQL connection string. Everything above the store takes a [`Db`];
//! nothing else in the crate looks at a connection string.

use std::fmt;
use std::path::{Path, PathBuf};

#[derive(Clone, PartialEq, Eq)]
/// The database a store opens.
pub enum Db {
    /// A SQLite file (the embedded default).
    Sqlite(PathBuf),
    /// A PostgreSQL connection string: a `postgres://` or `postgresql://`
    /// URL, or libpq's `key=value` form (`host=/run/pg dbname=x`).
    Postgres(String),
}

impl Db {
    /// Reads `--db`: a PostgreSQL connection string if it is spelled as
    /// one, else a SQLite path.
    pub fn parse(spec: &str) -> Db {
        let s = spec.trim_start();
        let url = s.starts_with("postgres://") || s.starts_with("postgresql://");
        let key_value = s.split_whitespace().next().is_some_and(|w| {
            w.split_once('=').is_some_and(|(k, _)| {
                ["host", "hostaddr", "dbname", "user", "port", "password", "options", "target_session_attrs"]
                    .contains(&k)
            })
        });
        match url || key_value {
            true => Db::Postgres(spec.to_owned()),
            false => Db::Sqlite(PathBuf::from(spec)),
        }
    }

    /// The text `--db` was given as, to hand to another process (a server
    /// the harness starts). Never print it: it may hold a password.
    pub fn to_arg(&self) -> std::ffi::OsString {
        match self {
            Db::Sqlite(path) => path.as_os_str().to_owned(),
            Db::Postgres(spec) => spec.into(),
        }
    }

    /// Whether this is PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        matches!(self, Db::Postgres(_))
    }

    /// The SQLite file, if this is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Db::Sqlite(path) => Some(path),
            Db::Postgres(_) => None,
        }
    }

    /// The same PostgreSQL database with `search_path` set to `schema`, in
    /// the form the connection string is in; a SQLite file is its own.
    pub fn in_schema(&self, schema: &str) -> Db {
        match self {
            Db::Sqlite(_) => self.clone(),
            Db::Postgres(spec) => {
                let options = format!("-c search_path={schema}");
                Db::Postgres(match spec.trim_start().starts_with("postgres") {
                    true => {
                        let sep = if spec.contains('?') { '&' } else { '?' };
                        format!("{spec}{sep}options={}", options.replace(' ', "%20").replace('=', "%3D"))
                    }
                    false => format!("{spec} options='{options}'"),
                })
            }
        }
    }
}

/// Never prints a connection string (it may hold a password).
impl fmt::Debug for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Db::Sqlite(path) => write!(f, "{}", path.display()),
            Db::Postgres(_) => f.write_str("the PostgreSQL database"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings_and_paths_are_told_apart() {
        for pg in
            ["postgres://u@h/d", "postgresql://h/d", "host=/run/pg dbname=x", "dbname=x", " user=u host=a,b"]
        {
            assert!(Db::parse(pg).is_postgres(), "{pg}");
        }
        for file in ["bank.db", "/tmp/host=x.db", "dir with space/b.db", "hostile"] {
            assert_eq!(Db::parse(file), Db::Sqlite(file.into()), "{file}");
        }
        assert!(!format!("{:?}", Db::parse("postgres://u:secret@h/d")).contains("secret"));
    }
}
