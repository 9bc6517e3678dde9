//! The engine's tables on PostgreSQL: checked, created once (under an
//! advisory lock), and the account table's shape read.

use super::*;

/// The comment that marks `idem_key` as this schema version.
/// Version 2 added `content_type`, version 3 `headers` and version 4
/// `body_bytes`, the key table's one shape (`store::keys`); a table of an
/// older version is upgraded on connect.
pub(super) const SCHEMA_MARK: &str = "idem schema 4";

/// The marks of the versions a connection upgrades.
const OLDER_MARKS: [&str; 3] = ["idem schema 1", "idem schema 2", "idem schema 3"];

/// Any constant: serialises schema creation across racing first calls.
pub(in crate::store) const SCHEMA_LOCK: i64 = 0x1de3_5c4e_3a00_0001;

/// Checks the account table, creates the engine's tables if missing, and
/// returns how `acct_id` is typed.
pub(super) fn prepare_schema(client: &mut Client) -> Result<Shape, StoreError> {
    let row = client
        .query_opt(
            "SELECT format_type(a.atttypid, a.atttypmod), t.typname, c.relkind::text
             FROM pg_class c
             JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'acct_id' AND NOT a.attisdropped
             JOIN pg_type t ON t.oid = a.atttypid
             WHERE c.oid = to_regclass('account')",
            &[],
        )
        .map_err(pg)?
        .ok_or_else(|| StoreError::Schema("database has no account table with an acct_id column".into()))?;
    let (acct_type, typname, relkind): (String, String, String) = (row.get(0), row.get(1), row.get(2));
    if !["r", "p"].contains(&relkind.as_str()) {
        return Err(StoreError::Schema("account is not a table".into()));
    }
    let int_ids = match typname.as_str() {
        "int2" | "int4" | "int8" => true,
        "text" | "varchar" | "bpchar" | "name" | "citext" => false,
        other => {
            return Err(StoreError::Schema(format!(
                "account.acct_id is of type {other}, neither text nor integer"
            )));
        }
    };
    let mut shape = Shape { acct_type, int_ids, schema: String::new(), path: String::new() };
    check_account(client)?;
    let mark: Option<String> = client
        .query_one("SELECT obj_description(to_regclass('idem_key'), 'pg_class')", &[])
        .map_err(pg)?
        .get(0);
    if mark.as_deref() != Some(SCHEMA_MARK) {
        create_schema(client, &shape)?;
    }
    let row = client
        .query_one(
            "SELECT quote_ident(n.nspname::text),
                    array_to_string(ARRAY(SELECT quote_ident(s::text) FROM unnest(current_schemas(false)) s), ', ')
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.oid = to_regclass('idem_key')",
            &[],
        )
        .map_err(pg)?;
    (shape.schema, shape.path) = (row.get(0), row.get(1));
    Ok(shape)
}

pub(super) fn check_account(client: &mut Client) -> Result<(), StoreError> {
    let row = client
        .query_one(
            "SELECT
               EXISTS (SELECT 1 FROM pg_index i
                       JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                       WHERE i.indrelid = to_regclass('account') AND i.indisunique AND i.indnkeyatts = 1
                         AND i.indpred IS NULL AND i.indexprs IS NULL AND a.attname = 'acct_id'),
               (SELECT string_agg(name, ', ' ORDER BY name) FROM (
                  SELECT tgname::text AS name FROM pg_trigger
                  WHERE NOT tgisinternal
                    AND tgrelid IN (to_regclass('account'), to_regclass('transfer'), to_regclass('idem_key'))
                  UNION ALL
                  SELECT rulename::text FROM pg_rewrite
                  WHERE ev_class IN (to_regclass('account'), to_regclass('transfer'), to_regclass('idem_key'))
                    AND rulename <> '_RETURN') AS acting)",
            &[],
        )
        .map_err(pg)?;
    if !row.get::<_, bool>(0) {
        return Err(StoreError::Schema(
            "account.acct_id is not unique (no PRIMARY KEY or UNIQUE index on it alone): \
             one transfer could move the balance of several rows"
                .into(),
        ));
    }
    match row.get::<_, Option<String>>(1) {
        Some(names) => Err(StoreError::Schema(format!(
            "trigger(s) or rule(s) {names} act on the engine's tables: a transfer must write exactly what the engine writes"
        ))),
        None => Ok(()),
    }
}

/// The columns an existing `transfer` or `idem_key` must have to be reused.
pub(super) const SHAPES: [(&str, &[&str]); 2] =
    [("transfer", &crate::store::TRANSFER_COLUMNS), ("idem_key", &crate::store::KEY_COLUMNS)];

pub(super) fn create_schema(client: &mut Client, shape: &Shape) -> Result<(), StoreError> {
    let mut tx = client.transaction().map_err(pg)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK]).map_err(pg)?;
    for (table, wanted) in SHAPES {
        let have: Vec<String> = tx
            .query(
                "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
                &[&table],
            )
            .map_err(pg)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let missing: Vec<&str> =
            wanted.iter().copied().filter(|c| !have.is_empty() && !have.iter().any(|h| h == c)).collect();
        if !missing.is_empty() {
            return Err(StoreError::Schema(format!(
                "table {table} exists without column(s) {}: not a schema this idem can use",
                missing.join(", ")
            )));
        }
    }
    let mark: Option<String> =
        tx.query_one("SELECT obj_description(to_regclass('idem_key'), 'pg_class')", &[]).map_err(pg)?.get(0);
    let upgrade = match mark.as_deref() {
        Some(SCHEMA_MARK) => return Ok(()), // another first call got here first
        Some(old) if OLDER_MARKS.contains(&old) => {
            "ALTER TABLE idem_key ADD COLUMN IF NOT EXISTS content_type text, ADD COLUMN IF NOT EXISTS headers text,
               ADD COLUMN IF NOT EXISTS body_bytes bytea;"
        }
        Some(other) if !other.is_empty() => {
            return Err(StoreError::Schema(format!(
                "idem_key is marked {other:?}; this idem understands {SCHEMA_MARK:?}"
            )));
        }
        _ => "",
    };
    let t = &shape.acct_type;
    // Times are RFC 3339 UTC text of fixed width in the C collation, so text
    // order is time order, and the same bytes as on SQLite.
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS transfer (
             transfer_id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
             src         {t} NOT NULL,
             dst         {t} NOT NULL,
             amount      bigint NOT NULL CHECK (amount > 0),
             currency    text NOT NULL,
             created_at  text COLLATE \"C\" NOT NULL);
         {}
         {upgrade}
         COMMENT ON TABLE idem_key IS '{SCHEMA_MARK}';",
        keys().create("idem_key_created_at", Dialect::Postgres)
    ))
    .map_err(pg)?;
    tx.commit().map_err(pg)
}

pub(super) const KEY_COLUMNS: &str = crate::store::RECORD_COLUMNS;

pub(super) const KEY_WHERE: &str = "client_id = $1 AND endpoint = $2 AND idem_key = $3";
