"""A minimal transfer endpoint behind asgi-idempotency-header (PyPI), for
`idem check --url` only: the same surface as `idem serve` (--db, --listen,
--clients; the first line is the URL), an in-memory ledger with accounts A
and B, and the middleware as its README says (Starlette, the package's
MemoryBackend, its defaults). The caller is authenticated in a middleware
outside it, so a refused token never reaches the key."""
import argparse, datetime, json, socket
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from idempotency_header_middleware import IdempotencyHeaderMiddleware
from idempotency_header_middleware.backends import MemoryBackend

p = argparse.ArgumentParser()
p.add_argument("--db")
p.add_argument("--listen", default="127.0.0.1:0")
p.add_argument("--clients", required=True)
a = p.parse_args()
clients = json.load(open(a.clients))
balances = {"A": 10**12, "B": 0}
next_id = [1]


class Authenticated:
    """One `Authorization: Bearer` of a known client, or 401."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            auths = [v for k, v in scope["headers"] if k == b"authorization"]
            token = auths[0].decode("latin-1").removeprefix("Bearer ") if len(auths) == 1 else None
            if token not in clients:
                return await JSONResponse({"reason": "unauthorized"}, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


async def transfer(request: Request):
    try:
        t = await request.json()
    except ValueError:
        return JSONResponse({"reason": "invalid_json"}, status_code=400)
    t = t if isinstance(t, dict) else {}
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


app = Starlette(
    routes=[Route("/v1/transfers", transfer, methods=["POST"])],
    middleware=[Middleware(Authenticated), Middleware(IdempotencyHeaderMiddleware, backend=MemoryBackend())],
)

host, port = a.listen.rsplit(":", 1)
sock = socket.socket()
sock.bind((host, int(port)))
sock.listen(128)  # listening before the URL is printed: a client that reads it can connect at once
print(f"http://{host}:{sock.getsockname()[1]}", flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
