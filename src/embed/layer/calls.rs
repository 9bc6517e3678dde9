//! The outside calls' table (`{prefix}idem_calls`) on whichever store the
//! layer runs: one text per statement, numbered `$n` (SQLite's `?n`), run
//! on the connection a [`Held`] holds. Values are integers and text only,
//! so every store reads and writes them alike.

use super::conn::{Conn, Held};
use crate::store::{Failure, StoreError};

/// A value bound to a statement.
pub(super) enum Val {
    I(i64),
    I32(i32),
    T(String),
    OptT(Option<String>),
    OptB(Option<Vec<u8>>),
}

/// A value read: the calls' columns are `BIGINT` or `TEXT`, never `NULL`.
#[derive(Debug, Clone)]
pub(super) enum Cell {
    I(i64),
    T(String),
}

impl Cell {
    pub(super) fn int(&self) -> i64 {
        match self {
            Cell::I(i) => *i,
            Cell::T(t) => t.parse().unwrap_or(0),
        }
    }

    pub(super) fn text(self) -> String {
        match self {
            Cell::I(i) => i.to_string(),
            Cell::T(t) => t,
        }
    }
}

/// One statement in both dialects.
pub(super) struct Sql {
    pg: String,
    lite: String,
}

impl Sql {
    /// `text` numbered `$n`; SQLite's copy numbers them `?n`.
    pub(super) fn new(text: String) -> Sql {
        Sql { lite: text.replace('$', "?"), pg: text }
    }
}

fn failed(e: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Backend(Failure::caused_by("the calls table", e))
}

/// A sqlx statement's rows, read as `ints` says (none: one empty row per
/// row changed): the same code on both databases.
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
macro_rules! sqlx_rows {
    ($db:ty, $sql:expr, $vals:expr, $conn:expr, $ints:expr) => {{
        use sqlx::Row;
        let mut q = sqlx::query::<$db>(sqlx::AssertSqlSafe($sql.as_str()));
        for v in $vals {
            q = match v {
                Val::I(i) => q.bind(*i),
                Val::I32(i) => q.bind(*i),
                Val::T(t) => q.bind(t.clone()),
                Val::OptT(t) => q.bind(t.clone()),
                Val::OptB(b) => q.bind(b.clone()),
            };
        }
        if $ints.is_empty() {
            let n = q.execute($conn).await.map_err(failed)?.rows_affected();
            return Ok(vec![Vec::new(); usize::try_from(n).unwrap_or(0)]);
        }
        let rows = q.fetch_all($conn).await.map_err(failed)?;
        rows.iter()
            .map(|r| {
                (0..$ints.len())
                    .map(|i| match $ints[i] {
                        true => r.try_get::<i64, _>(i).map(Cell::I),
                        false => r.try_get::<String, _>(i).map(Cell::T),
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(failed)
            })
            .collect()
    }};
}

impl Held {
    /// Runs `sql` with `vals`; how many rows it changed.
    pub(super) async fn exec(&mut self, sql: &Sql, vals: &[Val]) -> Result<u64, StoreError> {
        Ok(self.query(sql, vals, &[]).await?.len() as u64)
    }

    /// Runs `sql` with `vals`, reading each row's columns as `ints` says
    /// (`true`: an integer). A statement that returns no rows (`ints`
    /// empty) gives one empty row per row it changed.
    pub(super) async fn query(
        &mut self,
        sql: &Sql,
        vals: &[Val],
        ints: &[bool],
    ) -> Result<Vec<Vec<Cell>>, StoreError> {
        match &mut self.conn {
            #[cfg(feature = "postgres")]
            Conn::Pg(c) => {
                pg_query(c.as_ref().ok_or_else(crate::embed::gone)?.client(), sql, vals, ints).await
            }
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(c) => lite_query(c, sql, vals, ints),
            #[cfg(feature = "sqlx-postgres")]
            Conn::SqlxPg(tx) => {
                let conn = tx.as_deref_mut().ok_or_else(crate::embed::gone)?;
                sqlx_rows!(sqlx::Postgres, &sql.pg, vals, conn, ints)
            }
            #[cfg(feature = "sqlx-sqlite")]
            Conn::SqlxLite(tx, _) => {
                let conn = tx.as_deref_mut().ok_or_else(crate::embed::gone)?;
                sqlx_rows!(sqlx::Sqlite, &sql.lite, vals, conn, ints)
            }
        }
    }
}

#[cfg(feature = "sqlite")]
fn lite_value(v: &Val) -> rusqlite::types::Value {
    use rusqlite::types::Value;
    match v {
        Val::I(i) => Value::Integer(*i),
        Val::I32(i) => Value::Integer(i64::from(*i)),
        Val::T(t) | Val::OptT(Some(t)) => Value::Text(t.clone()),
        Val::OptB(Some(b)) => Value::Blob(b.clone()),
        Val::OptT(None) | Val::OptB(None) => Value::Null,
    }
}

#[cfg(feature = "postgres")]
async fn pg_query(
    c: &tokio_postgres::Client,
    sql: &Sql,
    vals: &[Val],
    ints: &[bool],
) -> Result<Vec<Vec<Cell>>, StoreError> {
    use tokio_postgres::types::ToSql;
    let params: Vec<&(dyn ToSql + Sync)> = vals
        .iter()
        .map(|v| match v {
            Val::I(i) => i as &(dyn ToSql + Sync),
            Val::I32(i) => i,
            Val::T(t) => t,
            Val::OptT(t) => t,
            Val::OptB(b) => b,
        })
        .collect();
    if ints.is_empty() {
        let n = c.execute(&sql.pg, &params).await.map_err(failed)?;
        return Ok(vec![Vec::new(); usize::try_from(n).unwrap_or(0)]);
    }
    let rows = c.query(&sql.pg, &params).await.map_err(failed)?;
    rows.iter()
        .map(|r| {
            (0..ints.len())
                .map(|i| match ints[i] {
                    true => r.try_get(i).map(Cell::I),
                    false => r.try_get(i).map(Cell::T),
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(failed)
        })
        .collect()
}

#[cfg(feature = "sqlite")]
fn lite_query(
    c: &rusqlite::Connection,
    sql: &Sql,
    vals: &[Val],
    ints: &[bool],
) -> Result<Vec<Vec<Cell>>, StoreError> {
    use rusqlite::types::{ToSql, Value, ValueRef};
    let params: Vec<Value> = vals.iter().map(lite_value).collect();
    let params: Vec<&dyn ToSql> = params.iter().map(|v| v as &dyn ToSql).collect();
    let mut st = c.prepare_cached(&sql.lite).map_err(failed)?;
    if ints.is_empty() {
        let n = st.execute(&params[..]).map_err(failed)?;
        return Ok(vec![Vec::new(); n]);
    }
    let rows = st.query_map(&params[..], |r| {
        (0..ints.len())
            .map(|i| match r.get_ref(i)? {
                ValueRef::Integer(n) => Ok(Cell::I(n)),
                v => Ok(Cell::T(v.as_str().map(String::from).unwrap_or_default())),
            })
            .collect::<rusqlite::Result<Vec<_>>>()
    });
    rows.map_err(failed)?.collect::<rusqlite::Result<Vec<_>>>().map_err(failed)
}
