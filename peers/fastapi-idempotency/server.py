"""A minimal transfer endpoint behind fastapi-idempotency (PyPI), for
`idem check --url` only: the same surface as `idem serve` (--db, --listen,
--clients; the first line is the URL), an in-memory ledger with accounts A
and B, and the middleware scoped by the caller's token as its README says."""
import argparse, datetime, json, socket
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi_idempotency import IdempotencyMiddleware

p = argparse.ArgumentParser()
p.add_argument("--db")
p.add_argument("--listen", default="127.0.0.1:0")
p.add_argument("--clients", required=True)
a = p.parse_args()
clients = json.load(open(a.clients))
balances = {"A": 10**12, "B": 0}
next_id = [1]


def caller(request: Request) -> str:
    token = request.headers.get("authorization", "").removeprefix("Bearer ")
    return "client:" + clients.get(token, "")


app = FastAPI()
app.add_middleware(IdempotencyMiddleware, scope=caller)


@app.post("/v1/transfers")
async def transfer(request: Request):
    token = request.headers.get("authorization", "").removeprefix("Bearer ")
    if token not in clients:
        return JSONResponse({"reason": "unauthorized"}, status_code=401)
    t = await request.json()
    src, dst, amount = t.get("src"), t.get("dst"), t.get("amount")
    if src not in balances or dst not in balances:
        return JSONResponse({"reason": "unknown_account"}, status_code=404)
    if type(amount) is not int or amount < 1 or src == dst or t.get("currency") != "KRW":
        return JSONResponse({"reason": "invalid_request"}, status_code=400)
    balances[src] -= amount
    balances[dst] += amount
    body = dict(transfer_id=next_id[0], src=src, dst=dst, amount=amount, currency="KRW",
                created_at=datetime.datetime.now(datetime.timezone.utc).isoformat())
    next_id[0] += 1
    return JSONResponse(body, status_code=201)


host, port = a.listen.rsplit(":", 1)
sock = socket.socket()
sock.bind((host, int(port)))
sock.listen(128)  # listening before the URL is printed: a client that reads it can connect at once
print(f"http://{host}:{sock.getsockname()[1]}", flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
