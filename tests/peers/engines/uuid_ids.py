#!/usr/bin/env python3
"""A lab engine in an object style, for the tests of `idem check` only:
UUID transfer ids, claims and responses in two tables keyed by the scope
as one JSON text, epoch milliseconds for times, insufficient funds as 422
(`not_enough_funds`), the answer printed with sorted members. Correct: it
must pass `idem check` with the profile `uuid_ids.json`."""
import time, argparse, datetime, hashlib, json, sqlite3, sys, uuid


class Engine:
    def __init__(self, path):
        self.db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10, isolation_level=None)
        # racing first calls: the switch to WAL may be refused at once, not waited for
        for attempt in range(200):
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or attempt == 199:
                    raise
                time.sleep(0.05)
        self.db.execute("SELECT 1 FROM account LIMIT 1")
        self.db.executescript("""
            CREATE TABLE IF NOT EXISTS transfer (transfer_id TEXT PRIMARY KEY, src, dst, amount INTEGER,
                                                 currency TEXT, created_at TEXT);
            CREATE TABLE IF NOT EXISTS claims (scope TEXT PRIMARY KEY, digest TEXT NOT NULL,
                                               holder TEXT NOT NULL, at_ms INTEGER NOT NULL);
            CREATE TABLE IF NOT EXISTS responses (scope TEXT PRIMARY KEY REFERENCES claims(scope),
                                                  status INTEGER, reason TEXT, body TEXT);""")

    def purge(self, cut):
        ms = int(cut.timestamp() * 1000)
        with_scope = [r[0] for r in self.db.execute("SELECT scope FROM claims WHERE at_ms < ?", (ms,))]
        self.db.execute("BEGIN IMMEDIATE")
        for scope in with_scope:
            self.db.execute("DELETE FROM responses WHERE scope = ?", (scope,))
            self.db.execute("DELETE FROM claims WHERE scope = ?", (scope,))
        self.db.execute("COMMIT")
        return len(with_scope)

    def handle(self, req, crash):
        body = req["body"]
        scope = json.dumps([req["client_id"], req["endpoint"], req["idem_key"]])
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        holder = str(uuid.uuid4())
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("INSERT INTO claims VALUES (?, ?, ?, ?)",
                            (scope, digest, holder, int(datetime.datetime.now().timestamp() * 1000)))
        except sqlite3.IntegrityError:
            seen = self.db.execute("SELECT c.digest, r.status, r.reason, r.body FROM claims c "
                                   "LEFT JOIN responses r ON r.scope = c.scope WHERE c.scope = ?", (scope,)).fetchone()
            self.db.execute("ROLLBACK")
            if seen[0] != digest:
                return 422, False, "fingerprint_mismatch", "null"
            if seen[1] is None:
                return 409, False, "in_progress", "null"
            return seen[1], True, seen[2], seen[3]
        self.db.execute("COMMIT")
        if crash:
            sys.exit(7)
        self.db.execute("BEGIN IMMEDIATE")
        if self.db.execute("SELECT holder FROM claims WHERE scope = ?", (scope,)).fetchone() != (holder,):
            self.db.execute("ROLLBACK")
            return 409, False, "in_progress", "null"
        balance = lambda acct: self.db.execute("SELECT balance FROM account WHERE acct_id = ?", (acct,)).fetchone()
        src, dst = balance(body["src"]), balance(body["dst"])
        if src is None or dst is None:
            status, reason, text = 404, "unknown_account", "null"
        elif src[0] < body["amount"]:
            status, reason, text = 422, "not_enough_funds", "null"
        else:
            tid, now = str(uuid.uuid4()), datetime.datetime.now(datetime.timezone.utc).isoformat()
            self.db.execute("INSERT INTO transfer VALUES (?, ?, ?, ?, ?, ?)",
                            (tid, body["src"], body["dst"], body["amount"], body["currency"], now))
            self.db.execute("UPDATE account SET balance = balance - ? WHERE acct_id = ?", (body["amount"], body["src"]))
            self.db.execute("UPDATE account SET balance = balance + ? WHERE acct_id = ?", (body["amount"], body["dst"]))
            status, reason = 201, None
            text = json.dumps({"amount": body["amount"], "created_at": now, "currency": body["currency"],
                               "dst": body["dst"], "src": body["src"], "transfer_id": tid}, sort_keys=True)
        self.db.execute("INSERT INTO responses VALUES (?, ?, ?, ?)", (scope, status, reason, text))
        self.db.execute("COMMIT")
        return status, False, reason, text


def valid(req):
    body = req.get("body")
    return (isinstance(req, dict) and set(req) == {"client_id", "endpoint", "idem_key", "body"}
            and all(isinstance(req[k], str) and req[k] for k in ("client_id", "endpoint", "idem_key"))
            and isinstance(body, dict) and set(body) == {"src", "dst", "amount", "currency"}
            and isinstance(body["amount"], int) and not isinstance(body["amount"], bool)
            and 0 < body["amount"] <= 2**53 - 1 and body["currency"] == "KRW" and body["src"] != body["dst"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--request")
    p.add_argument("--crash-after-claim", action="store_true")
    p.add_argument("--purge-before", type=datetime.datetime.fromisoformat)
    a = p.parse_args()
    try:
        engine = Engine(a.db)
    except sqlite3.Error as e:
        sys.exit(f"uuid_ids: {e}")
    if a.purge_before is not None:
        print(json.dumps({"purged": engine.purge(a.purge_before)}, sort_keys=True))
        return
    try:
        raw = open(a.request, "rb").read()
    except (OSError, TypeError) as e:
        print(f"uuid_ids: {e}", file=sys.stderr)
        sys.exit(3)
    try:
        req = json.loads(raw)
        ok = valid(req)
    except ValueError:
        ok = False
    status, replay, reason, text = engine.handle(req, a.crash_after_claim) if ok else (400, False, "bad_request", "null")
    print('{"body": %s, "reason": %s, "replay": %s, "status": %d}' % (text, json.dumps(reason), json.dumps(replay), status))


main()
