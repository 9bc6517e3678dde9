#!/usr/bin/env python3
"""A lab engine of plain functions, for the tests of `idem check` only: the
claim is INSERT OR IGNORE and the count of changed rows (the constraint
still decides), insufficient funds is a 400 that is stored (unlike a
malformed request's 400, which is not), reasons in words of its own, and
the answer pretty-printed over several lines. Correct: it must pass `idem
check` with the profile `procedural.json`."""
import time, argparse, datetime, hashlib, json, os, sqlite3, sys, uuid


def open_db(path):
    if not os.path.isfile(path):
        raise sqlite3.OperationalError("no such file")
    db = sqlite3.connect(path, timeout=15, isolation_level=None)
    # racing first calls: the switch to WAL may be refused at once, not waited for
    for attempt in range(200):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == 199:
                raise
            time.sleep(0.05)
    db.execute("PRAGMA busy_timeout=15000")
    db.execute("SELECT acct_id, balance FROM account LIMIT 1")
    db.execute("CREATE TABLE IF NOT EXISTS transfer (transfer_id INTEGER PRIMARY KEY, src, dst, amount, currency, created_at)")
    db.execute("CREATE TABLE IF NOT EXISTS idem (client_id, endpoint, idem_key, fp, token, created_at, "
               "done INTEGER DEFAULT 0, status, reason, body, UNIQUE (client_id, endpoint, idem_key))")
    return db


def emit(status, replay=False, reason=None, body=None):
    print(json.dumps({"status": status, "replay": replay, "reason": reason, "body": body}, indent=2, ensure_ascii=False))
    sys.exit(0)


def check(req):
    if not isinstance(req, dict) or sorted(req) != ["body", "client_id", "endpoint", "idem_key"]:
        return "the request must have client_id, endpoint, idem_key and body"
    for name in ("client_id", "endpoint", "idem_key"):
        if not isinstance(req[name], str) or not req[name]:
            return f"{name} must be a non-empty string"
    b = req["body"]
    if not isinstance(b, dict) or sorted(b) != ["amount", "currency", "dst", "src"]:
        return "the body must have src, dst, amount and currency"
    if type(b["amount"]) is not int or b["amount"] <= 0 or b["amount"] >= 2**53:
        return "the amount must be a positive integer"
    if b["currency"] != "KRW":
        return "only KRW"
    if b["src"] == b["dst"]:
        return "src and dst must differ"
    return None


def claim(db, scope, fp, token):
    db.execute("BEGIN IMMEDIATE")
    db.execute("INSERT OR IGNORE INTO idem (client_id, endpoint, idem_key, fp, token, created_at) VALUES (?,?,?,?,?,?)",
               scope + (fp, token, datetime.datetime.now(datetime.timezone.utc).isoformat()))
    mine = db.execute("SELECT changes()").fetchone()[0] == 1
    row = None if mine else db.execute(
        "SELECT fp, done, status, reason, body FROM idem WHERE client_id=? AND endpoint=? AND idem_key=?", scope).fetchone()
    db.execute("COMMIT" if mine else "ROLLBACK")
    return row


def execute(db, scope, token, b):
    db.execute("BEGIN IMMEDIATE")
    held = db.execute("SELECT token, done FROM idem WHERE client_id=? AND endpoint=? AND idem_key=?", scope).fetchone()
    if held != (token, 0):
        db.execute("ROLLBACK")
        emit(409, reason="in_progress")
    get = lambda acct: db.execute("SELECT balance FROM account WHERE acct_id=?", (acct,)).fetchone()
    src, dst = get(b["src"]), get(b["dst"])
    body = None
    if src is None or dst is None:
        status, reason = 404, "account not found"
    elif src[0] < b["amount"]:
        status, reason = 400, "balance too low"
    else:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        tid = db.execute("INSERT INTO transfer (src, dst, amount, currency, created_at) VALUES (?,?,?,?,?)",
                         (b["src"], b["dst"], b["amount"], b["currency"], now)).lastrowid
        db.execute("UPDATE account SET balance = balance - ? WHERE acct_id = ?", (b["amount"], b["src"]))
        db.execute("UPDATE account SET balance = balance + ? WHERE acct_id = ?", (b["amount"], b["dst"]))
        status, reason = 201, None
        body = {"transfer_id": tid, "src": b["src"], "dst": b["dst"], "amount": b["amount"], "currency": b["currency"], "created_at": now}
    db.execute("UPDATE idem SET done=1, status=?, reason=?, body=? WHERE client_id=? AND endpoint=? AND idem_key=?",
               (status, reason, json.dumps(body)) + scope)
    db.execute("COMMIT")
    emit(status, False, reason, body)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--request")
    p.add_argument("--crash-after-claim", action="store_true")
    p.add_argument("--purge-before")
    a = p.parse_args()
    try:
        db = open_db(a.db)
    except sqlite3.Error as e:
        sys.exit(f"procedural: {e}")
    if a.purge_before:
        try:
            cut = datetime.datetime.fromisoformat(a.purge_before)
        except ValueError:
            sys.exit(2)
        gone = [r[:3] for r in db.execute("SELECT client_id, endpoint, idem_key, created_at FROM idem")
                if datetime.datetime.fromisoformat(r[3]) < cut]
        for scope in gone:
            db.execute("DELETE FROM idem WHERE client_id=? AND endpoint=? AND idem_key=?", scope)
        print(json.dumps({"purged": len(gone)}))
        return
    try:
        text = open(a.request, encoding="utf-8").read()
    except (OSError, TypeError, UnicodeDecodeError):
        sys.exit(3)
    try:
        req = json.loads(text)
    except ValueError:
        emit(400, reason="not JSON")
    problem = check(req)
    if problem:
        emit(400, reason=problem)
    b = req["body"]
    scope = (req["client_id"], req["endpoint"], req["idem_key"])
    fp = hashlib.sha256(json.dumps(b, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    token = uuid.uuid4().hex
    row = claim(db, scope, fp, token)
    if row is not None:
        if row[0] != fp:
            emit(422, reason="key reused with another body")
        if not row[1]:
            emit(409, reason="in_progress")
        emit(row[2], True, row[3], json.loads(row[4]))
    if a.crash_after_claim:
        os._exit(9)
    execute(db, scope, token, b)


main()
