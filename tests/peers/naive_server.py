#!/usr/bin/env python3
"""A deliberately naive transfer service, for the tests only: the same HTTP
surface as `idem serve` (same arguments, first line `http://HOST:PORT`,
POST /v1/transfers with a bearer token), but it keeps no idempotency key and
stores no answer, so every request that reaches it moves money, retries
included. `idem chaos` and `idem check` must catch it paying twice. With
--lose-every N, every Nth transfer is answered 201 and rolled back (an
acknowledged transfer the database does not keep): the chaos verdict must
count it lost."""
import argparse, json, sqlite3, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--db", required=True)
parser.add_argument("--listen", default="127.0.0.1:0")
parser.add_argument("--clients", required=True)
parser.add_argument("--lose-every", type=int, default=0)
args = parser.parse_args()
served = 0
clients = json.load(open(args.clients))
lock = threading.Lock()
db = sqlite3.connect(args.db, check_same_thread=False, isolation_level=None)
db.execute("PRAGMA busy_timeout = 5000")
db.execute("""CREATE TABLE IF NOT EXISTS transfer (transfer_id INTEGER PRIMARY KEY, src, dst,
              amount INTEGER, currency TEXT, created_at TEXT)""")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        token = self.headers.get("Authorization", "").removeprefix("Bearer ")
        if token not in clients:
            return self.answer(401, {"reason": "unauthorized"})
        t = json.loads(body)
        global served
        with lock:
            served += 1
            n = served
            lose = args.lose_every > 0 and n % args.lose_every == 0
            db.execute("BEGIN IMMEDIATE")
            cur = db.execute("INSERT INTO transfer (src, dst, amount, currency, created_at) VALUES (?, ?, ?, ?, datetime())",
                             (t["src"], t["dst"], t["amount"], t["currency"]))
            db.execute("UPDATE account SET balance = balance - ? WHERE acct_id = ?", (t["amount"], t["src"]))
            db.execute("UPDATE account SET balance = balance + ? WHERE acct_id = ?", (t["amount"], t["dst"]))
            db.execute("ROLLBACK" if lose else "COMMIT")
        # a rolled-back row's id is the next one's: a lost one is told an id never kept
        self.answer(201, dict(t, transfer_id=10**9 + n if lose else cur.lastrowid))


host, port = args.listen.rsplit(":", 1)
server = ThreadingHTTPServer((host, int(port)), Handler)
print(f"http://{host}:{server.server_address[1]}", flush=True)
server.serve_forever()
