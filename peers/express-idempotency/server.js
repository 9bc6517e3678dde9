// A minimal transfer endpoint behind express-idempotency (npm), for
// `idem check --url` only: the same surface as `idem serve` (--db, --listen,
// --clients; the first line is the URL), an in-memory ledger with accounts A
// and B, and the middleware as its README says to use it.
const express = require('express');
const fs = require('fs');
const { idempotency, getSharedIdempotencyService } = require('express-idempotency');

const arg = (name, fallback) => {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : fallback;
};
const clients = JSON.parse(fs.readFileSync(arg('clients'), 'utf8'));
const [host, port] = arg('listen', '127.0.0.1:0').split(':');
const balances = { A: 1e12, B: 0 };
let nextId = 1;

const app = express();
app.use(express.json());
app.post('/v1/transfers', idempotency(), (req, res) => {
  const token = (req.get('authorization') || '').replace(/^Bearer /, '');
  if (!clients[token]) return res.status(401).json({ reason: 'unauthorized' });
  if (getSharedIdempotencyService().isHit(req)) return;
  const { src, dst, amount, currency } = req.body || {};
  if (!(src in balances) || !(dst in balances)) return res.status(404).json({ reason: 'unknown_account' });
  if (!Number.isInteger(amount) || amount < 1 || src === dst || currency !== 'KRW') {
    return res.status(400).json({ reason: 'invalid_request' });
  }
  balances[src] -= amount;
  balances[dst] += amount;
  res.status(201).json({ transfer_id: nextId++, src, dst, amount, currency, created_at: new Date().toISOString() });
});
const server = app.listen(Number(port), host, () => console.log(`http://${host}:${server.address().port}`));
