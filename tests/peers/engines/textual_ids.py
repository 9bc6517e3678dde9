#!/usr/bin/env python3
"""A lab engine in a terse style, for the tests of `idem check` only: text
transfer ids (`T000001`), a key table with column names of its own and
times as epoch seconds (REAL), insufficient funds answered 409
(`insufficient_funds`, told apart from in-flight by its reason), and the
answer's members printed in another order. Correct: it must pass `idem
check` with the profile `textual_ids.json`."""
import datetime, hashlib, json, sqlite3, sys, time, uuid

args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
crash = "--crash-after-claim" in sys.argv
if crash:
    args = dict(zip([a for a in sys.argv[1:] if a != "--crash-after-claim"][::2],
                    [a for a in sys.argv[1:] if a != "--crash-after-claim"][1::2]))
db_path = args.get("--db")
if not db_path:
    sys.exit(2)
try:
    db = sqlite3.connect(f"file:{db_path}?mode=rw", uri=True, timeout=10, isolation_level=None)
    # racing first calls: the switch to WAL may be refused at once, not waited for
    for attempt in range(200):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == 199:
                raise
            time.sleep(0.05)
    db.execute("SELECT 1 FROM account LIMIT 1")
except sqlite3.Error as e:
    sys.exit(f"textual_ids: {e}")
db.execute("CREATE TABLE IF NOT EXISTS transfer (transfer_id TEXT PRIMARY KEY, src, dst, amount, currency, created_at)")
db.execute("CREATE TABLE IF NOT EXISTS keys (k_client, k_endpoint, k_key, k_hash, k_done INTEGER, k_owner, k_at REAL,"
           " k_status INTEGER, k_reason, k_body, PRIMARY KEY (k_client, k_endpoint, k_key))")


def say(status, replay=False, reason=None, body="null"):
    sys.stdout.write('{"reason":%s,"body":%s,"status":%d,"replay":%s}\n' % (json.dumps(reason), body, status, "true" if replay else "false"))
    sys.exit(0)


if "--purge-before" in args:
    try:
        cut = datetime.datetime.fromisoformat(args["--purge-before"]).timestamp()
    except ValueError:
        sys.exit(2)
    say_purged = db.execute("DELETE FROM keys WHERE k_at < ?", (cut,)).rowcount
    print(json.dumps({"purged": say_purged}))
    sys.exit(0)
try:
    with open(args.get("--request", "")) as f:
        req = json.load(f)
except (OSError, IsADirectoryError) as e:
    sys.exit(3)
except ValueError:
    say(400, reason="malformed JSON")
try:
    c, e, k, b = req["client_id"], req["endpoint"], req["idem_key"], req["body"]
    assert len(req) == 4 and len(b) == 4 and all(type(x) is str and x for x in (c, e, k))
    assert type(b["amount"]) is int and 0 < b["amount"] < 2**53 and b["currency"] == "KRW" and b["src"] != b["dst"]
except Exception:
    say(400, reason="malformed request")
h = hashlib.sha256(json.dumps(b, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
me = uuid.uuid4().hex
db.execute("BEGIN IMMEDIATE")
try:
    db.execute("INSERT INTO keys VALUES (?,?,?,?,0,?,?,NULL,NULL,NULL)", (c, e, k, h, me, time.time()))
    db.execute("COMMIT")
except sqlite3.IntegrityError:
    old = db.execute("SELECT k_hash, k_done, k_status, k_reason, k_body FROM keys WHERE k_client=? AND k_endpoint=? AND k_key=?",
                     (c, e, k)).fetchone()
    db.execute("ROLLBACK")
    if old[0] != h:
        say(422, reason="fingerprint_mismatch")
    if not old[1]:
        say(409, reason="in_progress")
    say(old[2], True, old[3], old[4])
if crash:
    sys.exit(1)
db.execute("BEGIN IMMEDIATE")
if db.execute("SELECT k_owner FROM keys WHERE k_client=? AND k_endpoint=? AND k_key=?", (c, e, k)).fetchone()[0] != me:
    db.execute("ROLLBACK")
    say(409, reason="in_progress")
s = db.execute("SELECT balance FROM account WHERE acct_id=?", (b["src"],)).fetchone()
d = db.execute("SELECT balance FROM account WHERE acct_id=?", (b["dst"],)).fetchone()
if not (s and d):
    st, why, out = 404, "unknown_account", "null"
elif s[0] < b["amount"]:
    st, why, out = 409, "insufficient_funds", "null"
else:
    n = db.execute("SELECT COUNT(*) FROM transfer").fetchone()[0] + 1
    tid, at = f"T{n:06d}", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    db.execute("INSERT INTO transfer VALUES (?,?,?,?,?,?)", (tid, b["src"], b["dst"], b["amount"], "KRW", at))
    db.execute("UPDATE account SET balance=balance-? WHERE acct_id=?", (b["amount"], b["src"]))
    db.execute("UPDATE account SET balance=balance+? WHERE acct_id=?", (b["amount"], b["dst"]))
    st, why = 201, None
    out = json.dumps({"transfer_id": tid, "src": b["src"], "dst": b["dst"], "amount": b["amount"], "currency": "KRW", "created_at": at},
                     separators=(",", ":"))
db.execute("UPDATE keys SET k_done=1, k_status=?, k_reason=?, k_body=? WHERE k_client=? AND k_endpoint=? AND k_key=?",
           (st, why, out, c, e, k))
db.execute("COMMIT")
say(st, False, why, out)
