//! The keys an operator looks after: claims left in progress (`recover`)
//! and keys past retention (`purge`).

use crate::common::{Failure, db, now};
use idem::clock::Timestamp;
use idem::policy::Policy;
use idem::protocol;
use idem::request::ScopedKey;
use idem::store::{self, Db, Usage};
use serde_json::json;

/// List claims still in progress (live or stale) as JSON lines; --release deletes the stale ones.
///
/// A stale claim is one whose lease has run out: its process died before
/// moving money, so releasing it lets the next retry start afresh.
/// IDEM_NOW=<RFC 3339> fixes the clock.
#[derive(clap::Args, Debug)]
pub struct Recover {
    /// With --release: release live claims too, for holders known gone (a
    /// killed database backend, a server that died). Safe for money: a
    /// holder still running finds its claim gone, moves nothing and
    /// answers 409, and its retry executes afresh.
    #[arg(long, requires = "release")]
    force_live: bool,
    /// SQLite file or PostgreSQL connection string (or IDEM_DB, which keeps a password out of the process list).
    #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
    db: Db,
    /// Delete the stale claims: a line per released key, then {"released": N}.
    #[arg(long)]
    release: bool,
}

pub fn recover(Recover { force_live, db, release }: Recover, policy: &Policy) -> Result<(), Failure> {
    let now = now()?;
    let mut store = store::open(&db, policy, Usage::LongLived)?;
    let line = |state: &str, k: &ScopedKey, created_at: Timestamp, lease_until: Timestamp| {
        let (created_at, lease_until) = (created_at.to_string(), lease_until.to_string());
        json!({"state": state, "client_id": k.client_id, "endpoint": k.endpoint, "idem_key": k.idem_key,
               "created_at": created_at, "lease_until": lease_until})
    };
    let claims = protocol::open_claims(&mut store, now, policy)?;
    if !release {
        for c in &claims {
            say!("{}", line(if c.stale { "stale" } else { "live" }, &c.key, c.created_at, c.lease_until));
        }
        return Ok(());
    }
    if force_live {
        let live = claims.iter().filter(|c| !c.stale).count();
        eprintln!(
            "idem: releasing {live} live claim(s) too: a request still running under one \
             finds its claim gone, moves no money and answers 409; its retry executes afresh"
        );
    }
    let released = protocol::release_claims(&mut store, now, force_live, policy)?;
    for c in claims.iter().filter(|c| released.contains(&c.key)) {
        say!("{}", line("released", &c.key, c.created_at, c.lease_until));
    }
    say!("{}", json!({"released": released.len()}));
    Ok(())
}

/// Delete the keys past retention, in short batches; prints {"purged": N}.
///
/// Unlike `idem_api --purge-before`, this never deletes a key that a
/// retry could still need. Each batch is its own transaction, so live
/// traffic waits for the write lock at most one batch at a time.
/// IDEM_NOW=<RFC 3339> fixes the clock.
#[derive(clap::Args, Debug)]
pub struct Purge {
    /// SQLite file or PostgreSQL connection string (or IDEM_DB, which keeps a password out of the process list).
    #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
    db: Db,
    /// Keys deleted per transaction.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
}

pub fn purge(Purge { db, batch }: Purge, policy: &Policy) -> Result<(), Failure> {
    let now = now()?;
    let mut store = store::open(&db, policy, Usage::LongLived)?;
    let purged = protocol::purge_expired(&mut store, now, batch, policy)?;
    say!("{}", json!({"purged": purged}));
    Ok(())
}
