#!/usr/bin/env python3
"""An engine of the lab's command-line contract written in Python, for the
tests of `idem check --engine` only. With no --mistake it is a careful
implementation (claim by INSERT under BEGIN IMMEDIATE, a sorted-keys
fingerprint, a fenced execution, the stored answer replayed verbatim);
each --mistake is one of the lab's classic errors, which `idem check` must
catch:

  lookup     looks the key up first and inserts it later, with the money
  recompute  rebuilds a replay's body instead of returning the stored bytes
  global     keys by idem_key alone, not (client_id, endpoint, idem_key)

Usage: lab_engine.py [--mistake M] --db DB (--request FILE [--crash-after-claim] | --purge-before T)
"""
import argparse, datetime, hashlib, json, os, sqlite3, stat, sys, time, uuid

p = argparse.ArgumentParser()
p.add_argument("--mistake", choices=["lookup", "recompute", "global"])
p.add_argument("--db", required=True)
p.add_argument("--request")
p.add_argument("--crash-after-claim", action="store_true")
p.add_argument("--purge-before")
a = p.parse_args()


def now():
    fixed = os.environ.get("IDEM_NOW")
    t = datetime.datetime.fromisoformat(fixed.replace("Z", "+00:00")) if fixed else datetime.datetime.now(datetime.timezone.utc)
    return t.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def out(status, replay=False, reason=None, body="null"):
    reason = "null" if reason is None else json.dumps(reason)
    print('{"status":%d,"replay":%s,"reason":%s,"body":%s}' % (status, "true" if replay else "false", reason, body))
    sys.exit(0)


if not os.path.exists(a.db):
    sys.exit("lab_engine: no such database")
db = sqlite3.connect(a.db, isolation_level=None, timeout=5)
db.execute("PRAGMA journal_mode=WAL")
db.executescript("""
CREATE TABLE IF NOT EXISTS transfer (transfer_id INTEGER PRIMARY KEY, src, dst, amount INTEGER, currency TEXT, created_at TEXT);
CREATE TABLE IF NOT EXISTS idem_key (client_id TEXT, endpoint TEXT, idem_key TEXT, fingerprint TEXT, state TEXT,
  token TEXT, created_at TEXT, status INTEGER, reason TEXT, body TEXT, PRIMARY KEY (client_id, endpoint, idem_key));
""")

if a.purge_before:
    try:
        cut = datetime.datetime.fromisoformat(a.purge_before.replace("Z", "+00:00")).astimezone(datetime.timezone.utc)
    except ValueError:
        print("lab_engine: --purge-before is not RFC 3339", file=sys.stderr)
        sys.exit(2)
    n = db.execute("DELETE FROM idem_key WHERE created_at < ?", (cut.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),)).rowcount
    print(json.dumps({"purged": n}))
    sys.exit(0)

try:
    if not stat.S_ISREG(os.stat(a.request).st_mode):
        raise OSError("not a regular file")
    raw = open(a.request, "rb").read()
except OSError as e:
    print(f"lab_engine: {e}", file=sys.stderr)
    sys.exit(3)
try:
    req = json.loads(raw)
    body = req["body"]
    client, endpoint, key = req["client_id"], req["endpoint"], req["idem_key"]
    assert all(isinstance(x, str) and x for x in (client, endpoint, key))
    assert set(req) == {"client_id", "endpoint", "idem_key", "body"} and set(body) == {"src", "dst", "amount", "currency"}
    assert type(body["amount"]) is int and body["amount"] > 0 and body["currency"] == "KRW" and body["src"] != body["dst"]
except Exception:
    out(400, reason="invalid_request: malformed")
if a.mistake == "global":
    client, endpoint = "", ""
fp = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
token = uuid.uuid4().hex
t = now()


def answer(row):
    f, state, status, reason, stored = row
    if f != fp:
        out(422, reason="fingerprint_mismatch")
    if state != "completed":
        out(409, reason="in_progress")
    if a.mistake == "recompute" and status == 201:
        rebuilt = json.loads(stored)
        rebuilt["created_at"] = now()
        stored = json.dumps(rebuilt)
    out(status, True, reason, stored)


where = "client_id = ? AND endpoint = ? AND idem_key = ?"
if a.mistake == "lookup":
    row = db.execute(f"SELECT fingerprint, state, status, reason, body FROM idem_key WHERE {where}", (client, endpoint, key)).fetchone()
    if row:
        answer(row)
    time.sleep(0.02)  # the gap in which a racer looks too
else:
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("INSERT INTO idem_key VALUES (?, ?, ?, ?, 'in_progress', ?, ?, NULL, NULL, NULL)", (client, endpoint, key, fp, token, t))
        db.execute("COMMIT")
    except sqlite3.IntegrityError:
        row = db.execute(f"SELECT fingerprint, state, status, reason, body FROM idem_key WHERE {where}", (client, endpoint, key)).fetchone()
        db.execute("ROLLBACK")
        answer(row)
    if a.crash_after_claim:
        sys.exit(4)

db.execute("BEGIN IMMEDIATE")
if a.mistake == "lookup":
    db.execute("INSERT OR REPLACE INTO idem_key VALUES (?, ?, ?, ?, 'in_progress', ?, ?, NULL, NULL, NULL)", (client, endpoint, key, fp, token, t))
held = db.execute(f"SELECT token FROM idem_key WHERE {where}", (client, endpoint, key)).fetchone()
if not held or held[0] != token:
    db.execute("ROLLBACK")
    out(409, reason="in_progress")
src = db.execute("SELECT balance FROM account WHERE acct_id = ?", (body["src"],)).fetchone()
dst = db.execute("SELECT balance FROM account WHERE acct_id = ?", (body["dst"],)).fetchone()
if not src or not dst:
    status, reason, stored = 404, "unknown_account", "null"
elif src[0] < body["amount"]:
    status, reason, stored = 402, "insufficient_funds", "null"
else:
    cur = db.execute("INSERT INTO transfer (src, dst, amount, currency, created_at) VALUES (?, ?, ?, ?, ?)",
                     (body["src"], body["dst"], body["amount"], body["currency"], t))
    db.execute("UPDATE account SET balance = balance - ? WHERE acct_id = ?", (body["amount"], body["src"]))
    db.execute("UPDATE account SET balance = balance + ? WHERE acct_id = ?", (body["amount"], body["dst"]))
    status, reason = 201, None
    stored = json.dumps({"transfer_id": cur.lastrowid, "src": body["src"], "dst": body["dst"],
                         "amount": body["amount"], "currency": body["currency"], "created_at": t}, separators=(",", ":"))
db.execute(f"UPDATE idem_key SET state = 'completed', status = ?, reason = ?, body = ? WHERE {where}",
           (status, reason, stored, client, endpoint, key))
db.execute("COMMIT")
out(status, False, reason, stored)
