#!/usr/bin/env python3
"""The lab's straightforward idem_api.py, as its text suggests: stdlib sqlite3,
a key table with a three-column primary key, claim by INSERT inside BEGIN
IMMEDIATE (IntegrityError as the signal), json.dumps(sort_keys=True) for the
fingerprint, a second transaction that moves the money and completes the key.

Used only as a benchmark peer for `cargo bench --bench idem`; it is not part
of the engine and is not tested for correctness beyond what the bench checks.
"""
import argparse
import datetime
import hashlib
import json
import sqlite3
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--request")
    ap.add_argument("--crash-after-claim", action="store_true")
    args = ap.parse_args()
    try:
        with open(args.request, encoding="utf-8") as f:
            req = json.load(f)
    except OSError:
        sys.exit(3)
    body = req["body"]
    fp = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    key = (req["client_id"], req["endpoint"], req["idem_key"])
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    db = sqlite3.connect(args.db, isolation_level=None)
    db.execute("PRAGMA busy_timeout = 5000")
    db.executescript(
        """CREATE TABLE IF NOT EXISTS transfer (transfer_id INTEGER PRIMARY KEY, src, dst,
               amount INTEGER, currency TEXT, created_at TEXT);
           CREATE TABLE IF NOT EXISTS idem_key (client_id TEXT, endpoint TEXT, idem_key TEXT,
               fingerprint TEXT, state TEXT, status INTEGER, reason TEXT, body TEXT, created_at TEXT,
               PRIMARY KEY (client_id, endpoint, idem_key));"""
    )
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute(
            "INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, created_at)"
            " VALUES (?, ?, ?, ?, 'in_progress', ?)", (*key, fp, now))
        db.execute("COMMIT")
    except sqlite3.IntegrityError:
        row = db.execute(
            "SELECT fingerprint, state, status, reason, body FROM idem_key"
            " WHERE client_id = ? AND endpoint = ? AND idem_key = ?", key).fetchone()
        db.execute("ROLLBACK")
        if row[0] != fp:
            out = {"status": 422, "replay": False, "reason": "fingerprint_mismatch", "body": None}
        elif row[1] == "in_progress":
            out = {"status": 409, "replay": False, "reason": "in_progress", "body": None}
        else:
            out = {"status": row[2], "replay": True, "reason": row[3], "body": json.loads(row[4])}
        print(json.dumps(out))
        return
    if args.crash_after_claim:
        sys.exit(1)
    db.execute("BEGIN IMMEDIATE")
    src = db.execute("SELECT balance FROM account WHERE acct_id = ?", (body["src"],)).fetchone()
    dst = db.execute("SELECT balance FROM account WHERE acct_id = ?", (body["dst"],)).fetchone()
    if src is None or dst is None:
        status, reason, resp = 404, "unknown_account", None
    elif src[0] < body["amount"]:
        status, reason, resp = 402, "insufficient_funds", None
    else:
        cur = db.execute(
            "INSERT INTO transfer (src, dst, amount, currency, created_at) VALUES (?, ?, ?, ?, ?)",
            (body["src"], body["dst"], body["amount"], body["currency"], now))
        db.execute("UPDATE account SET balance = balance - ? WHERE acct_id = ?", (body["amount"], body["src"]))
        db.execute("UPDATE account SET balance = balance + ? WHERE acct_id = ?", (body["amount"], body["dst"]))
        status, reason = 201, None
        resp = {"transfer_id": cur.lastrowid, "src": body["src"], "dst": body["dst"],
                "amount": body["amount"], "currency": body["currency"], "created_at": now}
    db.execute(
        "UPDATE idem_key SET state = 'completed', status = ?, reason = ?, body = ?"
        " WHERE client_id = ? AND endpoint = ? AND idem_key = ?",
        (status, reason, json.dumps(resp), *key))
    db.execute("COMMIT")
    print(json.dumps({"status": status, "replay": False, "reason": reason, "body": resp}))


if __name__ == "__main__":
    main()
