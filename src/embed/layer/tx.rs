//! The handler's way into the request's open transaction, on whichever
//! store the layer runs.

use super::conn::{Conn, Held};
use super::problem;
use axum::extract::FromRequestParts;
use axum::http::{StatusCode, request::Parts};
use axum::response::Response;
use std::sync::Arc;
use tokio::sync::{Mutex, OwnedMutexGuard};

/// The handler's way into the open transaction: its writes commit with the
/// key and the answer, or roll back with them. Ask it for the store the
/// layer runs on: `Tx::client` (tokio-postgres), `Tx::sqlite` (rusqlite),
/// `Tx::sqlx_postgres`, `Tx::sqlx_sqlite` (each built with its store's
/// feature; not links, which a build without one would break); each is
/// `None` on another store. Run the handler's statements on what it gives, never
/// `COMMIT` or `ROLLBACK`: the layer does.
#[derive(Clone)]
pub struct Tx(pub(super) Arc<Mutex<Option<Held>>>);

/// A locked hold on the open transaction of one store's connection, which
/// derefs to it.
macro_rules! hold {
    ($(#[$doc:meta])* $feature:literal, $hold:ident, $get:ident, $target:ty, $made:pat, $c:pat => $conn:expr) => {
        $(#[$doc])*
        #[cfg(feature = $feature)]
        pub struct $hold(OwnedMutexGuard<Option<Held>>);

        #[cfg(feature = $feature)]
        impl Tx {
            #[doc = concat!("The open transaction's connection when the layer runs on `", $feature, "`; `None` on another store.")]
            pub async fn $get(&self) -> Option<$hold> {
                let held = self.0.clone().lock_owned().await;
                matches!(&*held, Some(Held { conn: $made, .. })).then_some($hold(held))
            }
        }

        #[cfg(feature = $feature)]
        impl std::ops::Deref for $hold {
            type Target = $target;
            fn deref(&self) -> &$target {
                match &*self.0 {
                    Some(Held { conn: $c, .. }) => $conn,
                    // checked when made, and held since: nothing can change it
                    _ => unreachable!("a {} holds a transaction of its store", stringify!($hold)),
                }
            }
        }
    };
}

/// sqlx runs a statement on `&mut` its connection.
macro_rules! hold_mut {
    ($feature:literal, $hold:ident, $target:ty, $c:pat => $conn:expr) => {
        #[cfg(feature = $feature)]
        impl std::ops::DerefMut for $hold {
            fn deref_mut(&mut self) -> &mut $target {
                match &mut *self.0 {
                    Some(Held { conn: $c, .. }) => $conn,
                    _ => unreachable!("a {} holds a transaction of its store", stringify!($hold)),
                }
            }
        }
    };
}

hold!(
    /// A locked hold on the open transaction's tokio-postgres client
    /// ([`Tx::client`]); derefs to it.
    "postgres", TxClient, client, tokio_postgres::Client, Conn::Pg(Some(_)), Conn::Pg(Some(c)) => c.client()
);
hold!(
    /// A locked hold on the open transaction's rusqlite connection
    /// ([`Tx::sqlite`]); derefs to it.
    "sqlite", TxSqlite, sqlite, rusqlite::Connection, Conn::Sqlite(_), Conn::Sqlite(c) => c
);
hold!(
    /// A locked hold on the open transaction's sqlx connection
    /// ([`Tx::sqlx_postgres`]): run the handler's queries on `&mut *hold`.
    /// A transaction begun on it is a savepoint in the request's.
    "sqlx-postgres", TxSqlxPg, sqlx_postgres, sqlx::PgConnection, Conn::SqlxPg(Some(_)), Conn::SqlxPg(Some(c)) => c
);
hold_mut!("sqlx-postgres", TxSqlxPg, sqlx::PgConnection, Conn::SqlxPg(Some(tx)) => tx);
hold!(
    /// A locked hold on the open transaction's sqlx connection
    /// ([`Tx::sqlx_sqlite`]), as `TxSqlxPg` is on PostgreSQL.
    "sqlx-sqlite", TxSqlxLite, sqlx_sqlite, sqlx::SqliteConnection, Conn::SqlxLite(Some(_), _), Conn::SqlxLite(Some(c), _) => c
);
hold_mut!("sqlx-sqlite", TxSqlxLite, sqlx::SqliteConnection, Conn::SqlxLite(Some(tx), _) => tx);

impl<S: Send + Sync> FromRequestParts<S> for Tx {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Tx, Response> {
        parts.extensions.get::<Tx>().cloned().ok_or_else(|| {
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "no_transaction",
                "The route has no idempotency layer.",
            )
        })
    }
}
