#!/usr/bin/env python3
"""A lab engine written the ordinary way, for the tests of `idem check`
only: the answer printed with json.dumps's defaults (a space after each
colon and comma), its own reason words, a key table that holds the claim
and the whole printed answer in one row, and a body that also tells the
source's balance after the transfer.

Correct with no --mistake, and correct with any --choice: each is the
other side of a choice the lab leaves open, which `idem check --engine`
must pass without a profile (and hold to once a profile declares it):

  refusals-evaluated  a refusal (unknown account, insufficient funds) is not
                      stored: the key stays free and a retry is evaluated again
  zero-amount         an amount of 0 is a transfer of nothing, not a 400
  js-numbers          numbers read as JavaScript reads them: 1e3 is 1000
  digit-strings       an amount written as a string of digits ("100") is taken
  exit3-unparseable   a request file that is not a request exits 3, unanswered
  json-broken-db      a database without `account` is answered (500), exit 0
  409-in-flight       another body under a key still in flight is 409, not 422
                      (the draft's order: in flight before the fingerprint)
  crash-answers       --crash-after-claim prints a 500 answer, then exits 4
  crash-on-used-key   --crash-after-claim on a key already claimed or completed
                      dies where the claim failed (exit 4, unanswered) instead
                      of answering the retry (the lab only says what a claim does)
  accounts-first      both accounts are looked up before the key is claimed: an
                      unknown account is refused (404) with the key untouched,
                      whatever the key holds and whatever the crash switch says

Each --mistake is one classic error of the lab, which `idem check --engine`
must catch on the property it breaks:

  lookup              looks the key up first, inserts it with the money
  completed-first     writes the key completed before the money moves
  raw-fingerprint     fingerprints the body as sent, not normalised
  recompute           rebuilds a replay from the ledger instead of the stored text
  global              keys by idem_key alone
  no-endpoint         keys by (client_id, idem_key), forgetting the endpoint
  purge-all           purges every key, whatever the cut
  purge-text          compares the cut with the stored times as text
  purge-expiry        purges by expiry (created + 72 h) instead of creation
  invalid-stored      stores a 400 under its key
  lost-update         reads balances before the write lock, writes them back absolute
  no-fingerprint      replays whatever the body
  replay-200          replays every answer with status 200
  crash-moves-money   --crash-after-claim exits after moving the money
  no-busy-timeout     waits for no lock: racers die with "database is locked"
  loose-amount        takes true, 1.5 and "100" for amounts
  stale-id            answers the id read as MAX(transfer_id) before its insert:
                      the transfer before, not its own
  no-funds-check      moves money the source does not have
  unreadable-crash    lets an unreadable request file's OSError escape:
                      a traceback and exit 1, not the lab's exit 3
"""
import argparse, datetime, hashlib, json, os, sqlite3, sys, time, uuid

MISTAKES = ["lookup", "completed-first", "raw-fingerprint", "recompute", "global", "no-endpoint",
            "purge-all", "purge-text", "purge-expiry", "invalid-stored", "lost-update",
            "no-fingerprint", "replay-200", "crash-moves-money", "no-busy-timeout", "loose-amount",
            "stale-id", "no-funds-check", "unreadable-crash"]
p = argparse.ArgumentParser()
CHOICES = ["refusals-evaluated", "zero-amount", "js-numbers", "digit-strings", "exit3-unparseable",
           "json-broken-db", "409-in-flight", "crash-answers", "crash-on-used-key", "accounts-first"]
p.add_argument("--mistake", choices=MISTAKES)
p.add_argument("--choice", choices=CHOICES, action="append", default=[])
p.add_argument("--db", required=True)
p.add_argument("--request")
p.add_argument("--crash-after-claim", action="store_true")
p.add_argument("--purge-before")
a = p.parse_args()
mistake = a.mistake
choice = set(a.choice)


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc)


def answer(status, replay=False, reason=None, body=None):
    print(json.dumps({"status": status, "replay": replay, "reason": reason, "body": body}))
    sys.exit(0)


if not os.path.isfile(a.db):
    print("no such database", file=sys.stderr)
    sys.exit(1)
db = sqlite3.connect(a.db, timeout=0 if mistake == "no-busy-timeout" else 10, isolation_level=None)
# racing first calls: the switch to WAL may be refused at once, not waited
# for (the no-busy-timeout mistake waits for no lock, this one included)
tries = 1 if mistake == "no-busy-timeout" else 200
for attempt in range(tries):
    try:
        db.execute("PRAGMA journal_mode=WAL")
        break
    except sqlite3.OperationalError as e:
        if "locked" not in str(e) or attempt == tries - 1:
            raise
        time.sleep(0.05)
try:
    db.execute("SELECT 1 FROM account LIMIT 1")
except sqlite3.Error as e:
    if "json-broken-db" in choice and a.request is not None:
        answer(500, reason=f"unusable database: {e}")
    print(f"unusable database: {e}", file=sys.stderr)
    sys.exit(1)
db.execute("""CREATE TABLE IF NOT EXISTS transfer (transfer_id INTEGER PRIMARY KEY AUTOINCREMENT,
  src TEXT, dst TEXT, amount INTEGER, currency TEXT, created_at TEXT)""")
db.execute("""CREATE TABLE IF NOT EXISTS idempotency (client_id TEXT, endpoint TEXT, idem_key TEXT,
  fingerprint TEXT, state TEXT, printed TEXT, created_at TEXT, owner TEXT,
  PRIMARY KEY (client_id, endpoint, idem_key))""")

if a.purge_before is not None:
    try:
        cut = datetime.datetime.fromisoformat(a.purge_before)
        if cut.tzinfo is None:
            raise ValueError("no offset")
    except ValueError as e:
        print(f"--purge-before: {e}", file=sys.stderr)
        sys.exit(2)
    if mistake == "purge-all":
        n = db.execute("DELETE FROM idempotency").rowcount
    elif mistake == "purge-text":
        n = db.execute("DELETE FROM idempotency WHERE created_at < ?", (a.purge_before,)).rowcount
    else:
        shift = datetime.timedelta(hours=72 if mistake == "purge-expiry" else 0)
        old = [r for r in db.execute("SELECT client_id, endpoint, idem_key, created_at FROM idempotency")
               if datetime.datetime.fromisoformat(r[3]) + shift < cut]
        db.executemany("DELETE FROM idempotency WHERE client_id = ? AND endpoint = ? AND idem_key = ?",
                       [r[:3] for r in old])
        n = len(old)
    print(json.dumps({"purged": n}))
    sys.exit(0)

try:
    raw = open(a.request, "rb").read()
except (OSError, TypeError) as e:
    if mistake == "unreadable-crash":
        raise
    print(f"cannot read the request: {e}", file=sys.stderr)
    sys.exit(3)


def amount_of(x):
    """The amount a choice reads `x` as, or x itself."""
    if "js-numbers" in choice and type(x) is float and x.is_integer():
        return int(x)
    if "digit-strings" in choice and type(x) is str and x.isdigit() and x[:1] != "0":
        return int(x)
    return x


def amount_ok(x):
    if "zero-amount" in choice and type(x) is int and x == 0:
        return True
    if mistake == "loose-amount":
        try:
            return float(x) > 0
        except (TypeError, ValueError):
            return False
    return type(x) is int and 0 < x < 2**53


try:
    req = json.loads(raw)
    body = req["body"]
    client, endpoint, key = req["client_id"], req["endpoint"], req["idem_key"]
    problem = None
    if not all(isinstance(x, str) and 0 < len(x) <= 255 for x in (client, endpoint, key)):
        problem = "bad scope"
    elif set(body) != {"src", "dst", "amount", "currency"}:
        problem = "bad fields"
    elif not amount_ok(amount_of(body["amount"])):
        problem = "bad amount"
    elif body["currency"] != "KRW" or body["src"] == body["dst"]:
        problem = "bad transfer"
except Exception:
    problem = "not a request"
    if "exit3-unparseable" in choice:
        print("the request file is not a request", file=sys.stderr)
        sys.exit(3)
if problem:
    if mistake == "invalid-stored" and isinstance(locals().get("key"), str):
        db.execute("INSERT OR IGNORE INTO idempotency VALUES (?, ?, ?, '', 'completed', ?, ?, '')",
                   (client, endpoint, key, json.dumps({"status": 400, "reason": problem}), utc_now().isoformat()))
    answer(400, reason=problem)
if mistake == "loose-amount":
    body["amount"] = int(float(body["amount"]))
body["amount"] = amount_of(body["amount"])

if mistake == "global":
    client, endpoint = "", ""
if mistake == "no-endpoint":
    endpoint = ""
if mistake == "raw-fingerprint":
    canonical = json.dumps(body)
else:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
fingerprint = hashlib.sha256(canonical.encode()).hexdigest()
scope = (client, endpoint, key)
owner = uuid.uuid4().hex


def replay_row(row):
    stored_fp, state, printed = row
    if "409-in-flight" in choice and state != "completed":
        answer(409, reason="in_progress")
    if stored_fp != fingerprint and mistake != "no-fingerprint":
        answer(422, reason="different body")
    if state != "completed":
        answer(409, reason="in_progress")
    first = json.loads(printed)
    if mistake == "recompute" and first.get("body"):
        t = first["body"]
        t["balance_after"] = db.execute("SELECT balance FROM account WHERE acct_id = ?", (t["src"],)).fetchone()[0]
    answer(200 if mistake == "replay-200" else first["status"], True, first.get("reason"), first.get("body"))


def lookup():
    return db.execute("SELECT fingerprint, state, printed FROM idempotency WHERE client_id = ? AND endpoint = ? AND idem_key = ?",
                      scope).fetchone()


if "accounts-first" in choice:
    for acct in (body["src"], body["dst"]):
        if db.execute("SELECT 1 FROM account WHERE acct_id = ?", (acct,)).fetchone() is None:
            answer(404, reason="no such account")

if mistake == "lookup":
    row = lookup()
    if row:
        replay_row(row)
    time.sleep(0.05)  # the time the transfer takes to prepare: a racer looks too
    if a.crash_after_claim:
        db.execute("INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, ?, 'in_progress', NULL, ?, ?)",
                   scope + (fingerprint, utc_now().isoformat(), owner))
        sys.exit(4)
else:
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            state = "completed" if mistake == "completed-first" else "in_progress"
            printed = None
            if mistake == "completed-first":
                printed = json.dumps({"status": 201, "reason": None, "body": {"pending": True}})
            db.execute("INSERT INTO idempotency VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       scope + (fingerprint, state, printed, utc_now().isoformat(), owner))
            db.execute("COMMIT")
        except sqlite3.IntegrityError:
            row = lookup()
            db.execute("ROLLBACK")
            if a.crash_after_claim and "crash-on-used-key" in choice:
                sys.exit(4)
            replay_row(row)
    except sqlite3.OperationalError as e:
        raise SystemExit(f"claim failed: {e}")
    if a.crash_after_claim and mistake != "crash-moves-money":
        if "crash-answers" in choice:
            print(json.dumps({"status": 500, "replay": False, "reason": "crashed_after_claim", "body": None}))
        sys.exit(4)

if mistake == "lost-update":
    before = {r[0]: r[1] for r in db.execute("SELECT acct_id, balance FROM account WHERE acct_id IN (?, ?)",
                                              (str(body["src"]), str(body["dst"])))}
    time.sleep(0.05)  # the time the transfer takes to prepare: a racer reads the same balances
db.execute("BEGIN IMMEDIATE")
if mistake == "lookup":
    db.execute("INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, ?, 'in_progress', NULL, ?, ?)",
               scope + (fingerprint, utc_now().isoformat(), owner))
held = db.execute("SELECT owner FROM idempotency WHERE client_id = ? AND endpoint = ? AND idem_key = ?", scope).fetchone()
if held is None or held[0] != owner:
    db.execute("ROLLBACK")
    answer(409, reason="in_progress")
src = db.execute("SELECT balance FROM account WHERE acct_id = ?", (body["src"],)).fetchone()
dst = db.execute("SELECT balance FROM account WHERE acct_id = ?", (body["dst"],)).fetchone()
amount = body["amount"]
if src is None or dst is None:
    status, reason, out = 404, "no such account", None
elif src[0] < amount and mistake != "no-funds-check":
    status, reason, out = 402, "not enough money", None
else:
    now = utc_now().isoformat()
    if mistake == "stale-id":  # the id it "will get", read before its insert, then not added to
        stale = db.execute("SELECT COALESCE(MAX(transfer_id), 0) FROM transfer").fetchone()[0]
    tid = db.execute("INSERT INTO transfer (src, dst, amount, currency, created_at) VALUES (?, ?, ?, ?, ?)",
                     (body["src"], body["dst"], amount, body["currency"], now)).lastrowid
    if mistake == "lost-update":
        db.execute("UPDATE account SET balance = ? WHERE acct_id = ?", (before[body["src"]] - amount, body["src"]))
        db.execute("UPDATE account SET balance = ? WHERE acct_id = ?", (before[body["dst"]] + amount, body["dst"]))
    else:
        db.execute("UPDATE account SET balance = balance - ? WHERE acct_id = ?", (amount, body["src"]))
        db.execute("UPDATE account SET balance = balance + ? WHERE acct_id = ?", (amount, body["dst"]))
    left = db.execute("SELECT balance FROM account WHERE acct_id = ?", (body["src"],)).fetchone()[0]
    if mistake == "stale-id":
        tid = stale
    status, reason = 201, None
    out = {"transfer_id": tid, "src": body["src"], "dst": body["dst"], "amount": amount,
           "currency": body["currency"], "created_at": now, "balance_after": left}
    if mistake == "crash-moves-money" and a.crash_after_claim:
        db.execute("COMMIT")
        sys.exit(4)
if "refusals-evaluated" in choice and status != 201:
    db.execute("DELETE FROM idempotency WHERE client_id = ? AND endpoint = ? AND idem_key = ?", scope)
else:
    db.execute("UPDATE idempotency SET state = 'completed', printed = ? WHERE client_id = ? AND endpoint = ? AND idem_key = ?",
               (json.dumps({"status": status, "reason": reason, "body": out}),) + scope)
db.execute("COMMIT")
answer(status, False, reason, out)
