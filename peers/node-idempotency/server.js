// A minimal transfer endpoint behind @node-idempotency/core (npm), for
// `idem check --url` only: the same surface as `idem serve` (--db, --listen,
// --clients; the first line is the URL), an in-memory ledger with accounts A
// and B. The package's own framework adapters are NestJS's (the express one
// its README links is not on npm), so this is the core driven as its README
// says, with what its NestJS interceptor adds (node-idempotency.iterceptor.js
// in @node-idempotency/nestjs 1.0.4): its error-to-status map and cached
// headers from @node-idempotency/shared, `Idempotent-Replayed: true` on a
// replay, `Retry-After: 1` on a request in progress, a thrown error stored
// as the key's answer. As in NestJS, the body is parsed and the caller
// authenticated (a guard) before the interceptor runs; options are the
// defaults.
const http = require('http');
const fs = require('fs');
const { Idempotency, IdempotencyError, IdempotencyErrorCodes } = require('@node-idempotency/core');
const { MemoryStorageAdapter } = require('@node-idempotency/storage-adapter-memory');
const { idempotency2HttpCodeMap, headers2Cache, HTTPHeaderEnum } = require('@node-idempotency/shared');

const arg = (name, fallback) => {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : fallback;
};
const clients = JSON.parse(fs.readFileSync(arg('clients'), 'utf8'));
const [host, port] = arg('listen', '127.0.0.1:0').split(':');
const balances = { A: 1e12, B: 0 };
let nextId = 1;
const idempotency = new Idempotency(new MemoryStorageAdapter());

// What a controller throws (NestJS's HttpException: a status and a body).
class HttpError {
  constructor(status, response) {
    this.status = status;
    this.response = response;
  }
}

// The business logic: the transfer made, or an HttpError thrown.
function transfer(body) {
  const { src, dst, amount, currency } = body || {};
  if (!(src in balances) || !(dst in balances)) throw new HttpError(404, { reason: 'unknown_account' });
  if (!Number.isInteger(amount) || amount < 1 || src === dst || currency !== 'KRW') {
    throw new HttpError(400, { reason: 'invalid_request' });
  }
  balances[src] -= amount;
  balances[dst] += amount;
  return { transfer_id: nextId++, src, dst, amount, currency, created_at: new Date().toISOString() };
}

function send(res, status, body, headers = {}) {
  res.writeHead(status, { 'Content-Type': 'application/json; charset=utf-8', ...headers });
  res.end(JSON.stringify(body));
}

// The interceptor's flow, on one request whose body is parsed.
async function intercepted(req, res, body) {
  const request = { headers: req.headers, body, path: req.url, method: req.method };
  let cached;
  try {
    cached = await idempotency.onRequest(request);
  } catch (err) {
    if (!(err instanceof IdempotencyError)) return send(res, 500, { statusCode: 500, message: 'Internal server error' });
    const status = idempotency2HttpCodeMap[err.code] || 500;
    const retry = err.code === IdempotencyErrorCodes.REQUEST_IN_PROGRESS ? { [HTTPHeaderEnum.retryAfter]: '1' } : {};
    return send(res, status, { statusCode: status, message: err.message }, retry);
  }
  if (cached) {
    const headers = { [HTTPHeaderEnum.idempotentReplayed]: 'true' };
    for (const name of Object.values(headers2Cache)) if (cached.additional?.[name]) headers[name] = cached.additional[name];
    const status = cached.additional?.statusCode ?? 500;
    return send(res, status, cached.body !== undefined ? cached.body : cached.error.response, headers);
  }
  try {
    const made = transfer(body);
    await idempotency.onResponse(request, {
      additional: { statusCode: 201, [headers2Cache.contentType]: 'application/json; charset=utf-8' },
      body: made,
    });
    send(res, 201, made);
  } catch (err) {
    const error = err instanceof HttpError ? err : new HttpError(500, { statusCode: 500, message: 'Internal server error' });
    await idempotency.onResponse(request, { additional: { statusCode: error.status }, error }).catch(() => {});
    send(res, error.status, error.response);
  }
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on('data', (c) => chunks.push(c));
  req.on('end', () => {
    if (req.method !== 'POST' || req.url !== '/v1/transfers') return send(res, 404, { reason: 'not_found' });
    // the guard: who the caller is, before anything else (one Authorization:
    // Node keeps the first of two, so they are counted in the raw headers)
    const auths = req.rawHeaders.filter((h, i) => i % 2 === 0 && h.toLowerCase() === 'authorization');
    const token = (req.headers.authorization || '').replace(/^Bearer /, '');
    if (auths.length !== 1 || !clients[token]) return send(res, 401, { reason: 'unauthorized' });
    let body;
    try {
      body = chunks.length ? JSON.parse(Buffer.concat(chunks).toString('utf8')) : {};
    } catch {
      return send(res, 400, { reason: 'invalid_json' });
    }
    intercepted(req, res, body).catch(() => send(res, 500, { statusCode: 500, message: 'Internal server error' }));
  });
});
server.listen(Number(port), host, () => console.log(`http://${host}:${server.address().port}`));
