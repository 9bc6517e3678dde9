#!/usr/bin/env python3
"""A transfer service of idem serve's surface written plainly on Python's
standard library, for the tests of `idem check --url` only: a threading
HTTP server, an in-memory ledger (the accounts read once from --db) and key
table behind one lock. Same flags as `idem serve` (--db, --listen,
--clients); the first line on stdout is the URL, printed once it listens.

Durable against its process's death, as `idem check --serve` needs: a
transfer and its key's completion change the ledger under one hold of the
lock, which then writes the whole state to DB.state.json (a new file
renamed over the old: a SIGKILL leaves the one before or the one after);
a restart reads it back. A claim in flight is not written: the process's
death forgets it with the transfer it never made. SIGTERM stops taking
connections, lets the requests being read or run finish, and exits.

--shape orders serves the same ledger as an API of another shape, for
`idem check`'s profile-driven bodies: POST /v1/orders takes
{"payer": {"account": SRC}, "payee": DST, "total": {"minor": AMOUNT,
"currency": "KRW"}} and answers {"order": {"id": "ord_N", ...}}, which
GET /v1/orders/ord_N shows.

Correct with no --mistake. Some --mistake values are no mistake under the
draft but a choice it leaves open, made the other way; the service stays
correct and `idem check --url` must pass it, unless the profile declares the
other choice (tests/peers/service-declared.json):

  chunked              answers in chunked transfer coding
  refusals-not-stored  a 404/402 refusal is not stored: its retry runs again
  no-replay-header     a replay is not marked Idempotent-Replayed
  no-retry-after       a 409 carries no Retry-After
  plain-errors         errors are text/plain, not problem+json
  bare-key-refused     a key that is not an sf-string ("...") is refused, 400
  other-statuses       200 for a transfer made, 422 for a malformed body, 403
                       for a bad token
  owned-accounts       an account belongs to the first client that pays from
                       it; another client's transfer from it is 404
                       unknown_account (its resource is not theirs to see)
  replay-header-always every answer, first ones too, is marked
                       Idempotent-Replayed: the draft names no header, so
                       this is wrong only for a service that declares it

Each other --mistake is one error `idem check` must catch on the property
it breaks:

  recompute            a replay is rebuilt from the ledger, not the stored bytes
  lookup-insert        looks the key up, processes, and only then stores it
  invalid-consumes     a 400 is stored under its key
  get-across-clients   GET /v1/transfers/{id} answers any client
  no-scope             keys are global, not per client
  key-before-auth      the key is read (and refused) before the token
  doubled-auth         of two Authorization headers, the first is taken
  leak                 error bodies show a traceback
  path-leak            error bodies name the database file by its absolute path
  missing-key-first    a request without a key is refused 400 before its token
                       is read (a bad token and no key: 400, not 401)
  quoted-distinct      "K" and K are two keys (the sf-string is not unquoted)
  token-scope          the scope is the token, not its client
  lost-update          balances read, then written back absolute
  no-key-processed     a request without a key is processed
  openapi-stale        its OpenAPI document (/openapi.json) lists no 422,
                       which it answers
  key-across-operations  keys are not scoped by route: a deposit under a
                       transfer's key replays the transfer and deposits nothing
  no-fingerprint       another body under a used key replays the first answer
  raw-fingerprint      the fingerprint is of the bytes sent, not the JSON
  fingerprint-no-dst   the fingerprint leaves out the destination: the key
                       paying C replays the earlier transfer to B
  fingerprint-one-part the fingerprint covers one sub-object of the body
                       (--shape orders: `total`; the transfers shape: the
                       amount and currency)
  fingerprint-top-sort the fingerprint is of the body as sent with only its
                       top-level members sorted (--shape orders: a retry
                       with nested members reordered is another request)
  in-flight-only       a key is held only while its request runs, then
                       forgotten: a retry after the answer is made again
  unknown-500          an unknown account is not looked for: the KeyError is
                       answered 500 by the catch-all, and its key freed
  stuck-on-hangup      a request whose client hung up keeps its writes but
                       never completes its key: 409 for ever (idem's library
                       before the key's one home, whose lease was 72 h)
  drop-on-hangup       a request whose client hung up keeps its writes and
                       frees its key: the retry pays again
  stuck-in-lock-wait   a request whose client hung up while it waited for
                       another's lock gives up there, its claim left held for
                       ever (a handler cancelled at its lock wait after a
                       claim committed apart); one not kept waiting is fine
  claim-committed-apart the claim is written before the transfer runs (as
                       idem's library once committed it apart, with a 72 h
                       lease): a process killed mid-request leaves its key
                       held for ever
  sigterm-ignored      SIGTERM is ignored (a server as PID 1 with no handler):
                       it never stops
  shutdown-abandons    SIGTERM ends the process at once (Python's default
                       with no handler): requests being read or run are
                       dropped unanswered
"""
import argparse, datetime, hashlib, http.server, json, os, select, signal, socket, sqlite3, sys, threading, time

CHOICES = ["chunked", "refusals-not-stored", "no-replay-header", "no-retry-after", "plain-errors", "bare-key-refused",
           "other-statuses", "replay-header-always", "owned-accounts"]
ERRORS = ["recompute", "lookup-insert", "invalid-consumes", "get-across-clients", "no-scope", "key-before-auth",
          "doubled-auth", "leak", "path-leak", "missing-key-first", "quoted-distinct", "token-scope", "lost-update", "no-key-processed", "key-across-operations", "openapi-stale",
          "no-fingerprint", "raw-fingerprint", "fingerprint-no-dst", "fingerprint-one-part", "in-flight-only", "unknown-500", "stuck-on-hangup",
          "drop-on-hangup", "stuck-in-lock-wait", "claim-committed-apart", "sigterm-ignored", "shutdown-abandons"]
# a mistake only in the orders shape (the transfers body is flat: sorting its
# top level is sorting it all)
SHAPE_ERRORS = ["fingerprint-top-sort"]
MISTAKES = CHOICES + ERRORS + SHAPE_ERRORS
p = argparse.ArgumentParser()
p.add_argument("--db", required=True)
p.add_argument("--listen", default="127.0.0.1:0")
p.add_argument("--clients", required=True)
p.add_argument("--mistake", choices=MISTAKES)
p.add_argument("--shape", choices=["transfers", "orders"], default="transfers")
a = p.parse_args()
mistake = a.mistake
ROUTE = "/v1/orders" if a.shape == "orders" else "/v1/transfers"
DEPOSITS = "/v1/deposits"
clients = json.load(open(a.clients))
STATE = a.db + ".state.json"
keys = {}        # scope -> {"fp", "done", "status", "body"; "held": written while in flight}
transfers = {}   # id -> [client, body text]
owners = {}      # account -> the client it belongs to (owned-accounts; not saved)
if os.path.exists(STATE):
    with open(STATE) as f:
        saved = json.load(f)
    balances, transfers = saved["balances"], saved["transfers"]
    keys = {tuple(s.split("\x00", 1)): v for s, v in saved["keys"].items()}
else:
    with sqlite3.connect(a.db) as db:
        balances = {str(k): v for k, v in db.execute("SELECT acct_id, balance FROM account")}
lock = threading.Lock()
running = [0]    # requests being read or run
stopping = threading.Event()


def save():
    """Writes the state (the lock held): done keys, and claims marked held."""
    kept = {"\x00".join(s): v for s, v in keys.items() if v["done"] or v.get("held")}
    with open(STATE + ".new", "w") as f:
        json.dump({"balances": balances, "keys": kept, "transfers": transfers}, f)
    os.replace(STATE + ".new", STATE)


def canonical(body):
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fingerprint(raw, t):
    """The request's fingerprint: of its normalized transfer `t`, or as a mistake says."""
    if mistake == "raw-fingerprint":
        return hashlib.sha256(raw).hexdigest()
    if mistake == "fingerprint-no-dst":
        return canonical({k: v for k, v in t.items() if k != "dst"})
    sent = json.loads(raw)
    if mistake == "fingerprint-one-part":
        return canonical(sent["total"] if a.shape == "orders" else {"amount": t["amount"], "currency": t["currency"]})
    if mistake == "fingerprint-top-sort":
        return hashlib.sha256(json.dumps({k: sent[k] for k in sorted(sent)}, separators=(",", ":")).encode()).hexdigest()
    return canonical(t)


def made_id(body):
    made = json.loads(body)
    if "deposit_id" in made:
        return made["deposit_id"]
    return made["order"]["id"] if a.shape == "orders" else made["transfer_id"]


def openapi():
    """Its OpenAPI document: the statuses each operation answers (a stale one
    under openapi-stale, which lists no 422)."""
    made, bad_token = ("200", "403") if mistake == "other-statuses" else ("201", "401")
    post = [made, "400", bad_token, "402", "404", "409", "412", "422", "500"]
    if mistake == "openapi-stale":
        post.remove("422")
    ops = {ROUTE: {"post": post}, ROUTE + "/{id}": {"get": ["200", bad_token, "404"]},
           DEPOSITS: {"post": [made, "400", bad_token, "409", "422"]}, "/openapi.json": {"get": ["200"]}}
    paths = {path: {m: {"responses": {s: {"description": s} for s in statuses}} for m, statuses in item.items()}
             for path, item in ops.items()}
    return {"openapi": "3.1.0", "info": {"title": "http_service.py", "version": "1"}, "paths": paths}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body, headers=()):
        data = body.encode()
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if mistake == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(data), 7):
                piece = data[i:i + 7]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def problem(self, status, reason, extra=()):
        if mistake == "other-statuses":
            status = {401: 403, 400: 422 if reason == "invalid_request" else 400}.get(status, status)
        if mistake == "plain-errors":
            return self.reply(status, reason, [("Content-Type", "text/plain")] + list(extra))
        detail = reason
        if mistake == "leak":
            detail = "Traceback (most recent call last):\n  File \"/srv/app.py\", line 12\nKeyError: " + reason
        if mistake == "path-leak":
            detail = f"{reason} (database {os.path.abspath(a.db)})"
        body = json.dumps({"type": "about:blank", "title": reason, "status": status, "detail": detail, "reason": reason})
        self.reply(status, body, [("Content-Type", "application/problem+json")] + list(extra))

    def client(self):
        values = self.headers.get_all("Authorization") or []
        if len(values) != 1 and not (mistake == "doubled-auth" and values):
            return None
        token = values[0].removeprefix("Bearer ").strip()
        if token not in clients:
            return None
        return token if mistake == "token-scope" else clients[token]

    def key(self):
        values = self.headers.get_all("Idempotency-Key") or []
        if len(values) != 1:
            return None
        k = values[0].strip()
        if mistake == "bare-key-refused" and not (len(k) >= 2 and k[0] == k[-1] == '"'):
            return None
        if len(k) >= 2 and k[0] == k[-1] == '"' and mistake != "quoted-distinct":
            k = k[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        return k or None

    def do_GET(self):
        if self.path == "/openapi.json":
            return self.reply(200, json.dumps(openapi()), [("Content-Type", "application/json")])
        who = self.client()
        if who is None:
            return self.problem(401, "unauthorized")
        if not self.path.startswith(ROUTE + "/"):
            return self.problem(404, "not_found")
        found = transfers.get(self.path.rsplit("/", 1)[1])
        if found and (found[0] == who or mistake == "get-across-clients"):
            return self.reply(200, found[1], [("Content-Type", "application/json")])
        self.problem(404, "not_found")

    def do_POST(self):
        with lock:
            running[0] += 1
        try:
            self.post()
        finally:
            with lock:
                running[0] -= 1
            self.close_connection = self.close_connection or stopping.is_set()

    def post(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if mistake == "key-before-auth" and self.key() is None:
            return self.problem(400, "invalid_idempotency_key")
        if mistake == "missing-key-first" and not self.headers.get_all("Idempotency-Key"):
            return self.problem(400, "missing_idempotency_key")
        who = self.client()
        if who is None:
            return self.problem(401, "unauthorized")
        if self.path == DEPOSITS:
            return self.deposit(who, raw)
        if self.path != ROUTE:
            return self.problem(404, "not_found")
        key = self.key()
        if key is None and mistake != "no-key-processed":
            return self.problem(400, "missing_idempotency_key")
        try:
            t = json.loads(raw)
            if a.shape == "orders":
                assert isinstance(t, dict) and set(t) == {"payer", "payee", "total"}
                payer, total = t["payer"], t["total"]
                assert isinstance(payer, dict) and set(payer) == {"account"}
                assert isinstance(total, dict) and set(total) == {"minor", "currency"}
                t = {"src": payer["account"], "dst": t["payee"], "amount": total["minor"], "currency": total["currency"]}
            assert isinstance(t, dict) and set(t) == {"src", "dst", "amount", "currency"}
            assert type(t["amount"]) is int and t["amount"] > 0 and t["currency"] == "KRW" and t["src"] != t["dst"]
            assert all(isinstance(t[x], (str, int)) and not isinstance(t[x], bool) for x in ("src", "dst"))
        except Exception:
            if mistake == "invalid-consumes" and key:
                with lock:
                    keys.setdefault(("" if mistake == "no-scope" else who, key), {"fp": "", "done": True, "status": 400,
                                    "body": json.dumps({"reason": "invalid_request", "status": 400})})
            return self.problem(400, "invalid_request")
        scope = ("" if mistake == "no-scope" else who, key if key is not None else str(time.time_ns()))
        fp = fingerprint(raw, t)
        if mistake == "lookup-insert":
            with lock:
                seen = keys.get(scope)
            if seen is None:
                time.sleep(0.05)  # the transfer is prepared meanwhile; a racer looks too
                with lock:
                    status, body = self.transfer(who, t)
                with lock:
                    keys[scope] = {"fp": fp, "done": True, "status": status, "body": body}
                return self.answer(status, body, False)
        else:
            with lock:
                seen = keys.get(scope)
                if seen is None:
                    keys[scope] = {"fp": fp, "done": False, "held": mistake == "claim-committed-apart"}
                    if mistake == "claim-committed-apart":
                        save()
        if seen is not None:
            if seen["fp"] != fp and seen["fp"] and mistake != "no-fingerprint":
                return self.problem(422, "fingerprint_mismatch")
            if not seen["done"]:
                extra = [] if mistake == "no-retry-after" else [("Retry-After", "1")]
                return self.problem(409, "in_progress", extra)
            body = seen["body"]
            if mistake == "recompute" and seen["status"] == 201:
                rebuilt = json.loads(body)
                rebuilt["balance_after"] = balances[str(rebuilt["src"])]
                body = json.dumps(rebuilt)
            return self.answer(seen["status"], body, True)
        time.sleep(0.005)  # the transfer's own work
        read = None
        if mistake == "lost-update":
            with lock:
                read = balances.get(str(t["src"])), balances.get(str(t["dst"]))
            time.sleep(0.02)
        hung = mistake in ("stuck-on-hangup", "drop-on-hangup") and self.hung_up()
        if mistake == "stuck-in-lock-wait" and not lock.acquire(blocking=False):
            with lock:  # kept waiting for another request's commit
                cancelled = self.hung_up()
                if cancelled:
                    keys[scope]["held"] = True
                    save()
            if cancelled:
                return
        elif mistake == "stuck-in-lock-wait":
            lock.release()
        with lock:  # the transfer and its key's completion: one commit
            try:
                status, body = self.transfer(who, t, read)
            except KeyError:  # unknown-500: the framework's catch-all
                status = 500
                del keys[scope]
            if hung:  # the writes kept; the key held for ever, or freed
                if mistake == "drop-on-hangup":
                    del keys[scope]
                else:
                    keys[scope]["held"] = True
            elif status == 500:
                pass
            elif mistake == "in-flight-only" or status in (402, 404) and mistake == "refusals-not-stored":
                del keys[scope]
            else:
                keys[scope] = {"fp": fp, "done": True, "status": status, "body": body}
            save()
        if hung:
            return
        if status == 500:
            return self.problem(500, "internal_error")
        self.answer(status, body, False)

    def hung_up(self):
        """Whether the client has closed its side of the connection."""
        if not select.select([self.connection], [], [], 0)[0]:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def deposit(self, who, raw):
        """POST /v1/deposits {"account", "amount"}: a second operation with keys
        of its own (scoped by route; not under key-across-operations)."""
        key = self.key()
        if key is None:
            return self.problem(400, "missing_idempotency_key")
        try:
            d = json.loads(raw)
            assert isinstance(d, dict) and set(d) == {"account", "amount"} and str(d["account"]) in balances
            assert type(d["amount"]) is int and d["amount"] > 0
        except Exception:
            return self.problem(400, "invalid_request")
        scope = (who, key if mistake == "key-across-operations" else "deposit:" + key)
        fp = "deposit:" + canonical(d)
        with lock:
            seen = keys.get(scope)
            if seen is not None:
                if seen["fp"] != fp and mistake != "key-across-operations":
                    return self.problem(422, "fingerprint_mismatch")
                if not seen["done"]:
                    return self.problem(409, "in_progress", [("Retry-After", "1")])
                return self.answer(seen["status"], seen["body"], True)
            account = str(d["account"])
            balances[account] += d["amount"]
            body = json.dumps({"deposit_id": f"dep_{len(keys)}", "account": d["account"], "amount": d["amount"],
                               "balance_after": balances[account]})
            keys[scope] = {"fp": fp, "done": True, "status": 201, "body": body}
            save()
        return self.answer(201, body, False)

    def transfer(self, who, t, read=None):
        """Moves the money (the lock held); `read`: balances read before (lost-update)."""
        src, dst, amount = str(t["src"]), str(t["dst"]), t["amount"]
        if (src not in balances or dst not in balances) and mistake != "unknown-500":
            return 404, json.dumps({"reason": "unknown_account", "status": 404})
        if mistake == "owned-accounts" and owners.setdefault(src, who) != who:
            return 404, json.dumps({"reason": "unknown_account", "status": 404})
        have = read[0] if mistake == "lost-update" else balances[src]
        if have < amount:
            return 402, json.dumps({"reason": "insufficient_funds", "status": 402})
        if mistake == "lost-update":
            balances[src], balances[dst] = read[0] - amount, read[1] + amount
        else:
            balances[src] -= amount
            balances[dst] += amount
        tid = str(len(transfers) + 1)
        at = datetime.datetime.now(datetime.timezone.utc).isoformat()
        if a.shape == "orders":
            tid = f"ord_{tid}"
            body = json.dumps({"order": {"id": tid, "payer": {"account": t["src"]}, "payee": t["dst"],
                                         "total": {"minor": amount, "currency": "KRW"}, "created_at": at}})
        else:
            body = json.dumps({"transfer_id": int(tid), "src": t["src"], "dst": t["dst"], "amount": amount,
                               "currency": "KRW", "created_at": at, "balance_after": balances[src]})
        transfers[tid] = [who, body]
        return 201, body

    def answer(self, status, body, replayed):
        marked = replayed and mistake != "no-replay-header" or mistake == "replay-header-always"
        extra = [("Idempotent-Replayed", "true")] if marked else []
        if status == 201:
            route = DEPOSITS if "deposit_id" in json.loads(body) else ROUTE
            return self.reply(200 if mistake == "other-statuses" else 201, body, [("Content-Type", "application/json"),
                                          ("Location", f"{route}/{made_id(body)}")] + extra)
        reason = json.loads(body)["reason"]
        self.problem(status, reason, extra)


host, port = a.listen.rsplit(":", 1)
server = http.server.ThreadingHTTPServer((host, int(port)), Handler)
server.daemon_threads = True


def stop(*_):
    stopping.set()
    threading.Thread(target=server.shutdown).start()


if mistake == "sigterm-ignored":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif mistake != "shutdown-abandons":
    signal.signal(signal.SIGTERM, stop)
print(f"http://{host}:{server.server_address[1]}", flush=True)
server.serve_forever()
server.server_close()  # no more connections: those queued are refused
until = time.monotonic() + 25
while running[0] and time.monotonic() < until:
    time.sleep(0.01)
sys.exit(0)
