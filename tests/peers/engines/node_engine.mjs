#!/usr/bin/env node
// A lab engine in Node.js, for the tests of `idem check` only. It reads
// JSON as JavaScript does: every number is a double, so `1e3` is the
// integer 1000 and is taken as that amount, and an amount past 2^53 is no
// safe integer (a 400). The fingerprint is the body with its members
// sorted, written by JSON.stringify (so `1e3` and `1000` are one body).
// Node 20 has no SQLite of its own: the engine talks to the sqlite3 shell
// over a pipe, one statement at a time, inside one transaction. Every
// string goes in as a hex blob cast to TEXT, so no quoting is involved.
//
//   node node_engine.mjs --db FILE --request FILE [--crash-after-claim]
//   node node_engine.mjs --db FILE --purge-before RFC3339
import { spawn } from "node:child_process";
import { createHash, randomUUID } from "node:crypto";
import { existsSync, readFileSync } from "node:fs";

const args = process.argv.slice(2);
const flag = (name) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const crash = args.includes("--crash-after-claim");
const dbPath = flag("--db");
const END = "@@end-of-statement@@";

const lit = (v) =>
  typeof v === "number" ? String(v) : v === null ? "NULL" : `CAST(X'${Buffer.from(String(v), "utf8").toString("hex")}' AS TEXT)`;

/** A sqlite3 shell on a pipe: `q(sql)` runs one statement and gives its rows. */
function shell(file) {
  const child = spawn("sqlite3", ["-bail", "-json", file], { stdio: ["pipe", "pipe", "pipe"] });
  let out = "";
  let err = "";
  let waiting = null;
  const settle = () => {
    const at = out.indexOf(END);
    if (waiting && at >= 0) {
      const text = out.slice(0, out.lastIndexOf("[", at)).trim();
      out = out.slice(out.indexOf("\n", at) + 1);
      const w = waiting;
      waiting = null;
      w.resolve(text || "[]");
    }
  };
  child.stdout.on("data", (d) => ((out += d), settle()));
  child.stderr.on("data", (d) => (err += d));
  child.on("close", () => waiting && waiting.reject(new Error(err.trim() || "sqlite3 ended")));
  child.stdin.write(".timeout 10000\n");
  return {
    q(sql) {
      return new Promise((resolve, reject) => {
        waiting = { resolve: (t) => resolve(JSON.parse(t)), reject };
        child.stdin.write(`${sql};\nSELECT '${END}' AS e;\n`);
      });
    },
    end() {
      child.stdin.end();
    },
  };
}

function say(status, replay, reason, body) {
  process.stdout.write(JSON.stringify({ status, replay, reason, body }) + "\n");
  process.exit(0);
}

function fail(code, why) {
  process.stderr.write(why + "\n");
  process.exit(code);
}

const sorted = (v) =>
  v && typeof v === "object" && !Array.isArray(v)
    ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, sorted(v[k])]))
    : v;

async function main() {
  if (!dbPath) fail(2, "--db is required");
  if (!existsSync(dbPath)) fail(1, "no such database");
  const db = shell(dbPath);
  try {
    await db.q("SELECT 1 FROM account LIMIT 1");
  } catch (e) {
    fail(1, `unusable database: ${e.message}`);
  }
  await db.q(`CREATE TABLE IF NOT EXISTS transfer (transfer_id INTEGER PRIMARY KEY AUTOINCREMENT,
    src TEXT, dst TEXT, amount INTEGER, currency TEXT, created_at TEXT)`);
  await db.q(`CREATE TABLE IF NOT EXISTS node_keys (client_id TEXT, endpoint TEXT, idem_key TEXT,
    fp TEXT, state TEXT, answer TEXT, made_ms INTEGER, owner TEXT, PRIMARY KEY (client_id, endpoint, idem_key))`);

  const purge = flag("--purge-before");
  if (purge !== undefined) {
    const cut = Date.parse(purge);
    if (!/([zZ]|[+-]\d\d:\d\d)$/.test(purge) || Number.isNaN(cut)) fail(2, `--purge-before: not an RFC 3339 time: ${purge}`);
    const [{ n }] = await db.q(`SELECT count(*) AS n FROM node_keys WHERE made_ms < ${cut}`);
    await db.q(`DELETE FROM node_keys WHERE made_ms < ${cut}`);
    db.end();
    process.stdout.write(JSON.stringify({ purged: n }) + "\n");
    process.exit(0);
  }

  let raw;
  try {
    raw = readFileSync(flag("--request"), "utf8");
  } catch (e) {
    fail(3, `cannot read the request: ${e.message}`);
  }
  let req, problem = null;
  try {
    req = JSON.parse(raw);
    const { client_id, endpoint, idem_key, body } = req;
    const text = (s) => typeof s === "string" && s.length > 0 && s.length <= 255;
    const keys = body && typeof body === "object" ? Object.keys(body).sort().join(",") : "";
    const id = (x) => (typeof x === "string" && x !== "") || Number.isSafeInteger(x);
    if (![client_id, endpoint, idem_key].every(text)) problem = "scope must be three short strings";
    else if (keys !== "amount,currency,dst,src") problem = "body must hold src, dst, amount, currency";
    else if (!Number.isSafeInteger(body.amount) || body.amount <= 0) problem = "amount must be a positive integer";
    else if (body.currency !== "KRW" || !id(body.src) || !id(body.dst) || body.src === body.dst) problem = "not a transfer";
  } catch {
    problem = "the request is not JSON";
  }
  if (problem) say(400, false, problem, null);

  const { client_id, endpoint, idem_key, body } = req;
  const fp = createHash("sha256").update(JSON.stringify(sorted(body))).digest("hex");
  const scope = `client_id = ${lit(client_id)} AND endpoint = ${lit(endpoint)} AND idem_key = ${lit(idem_key)}`;
  const owner = randomUUID();

  await db.q("BEGIN IMMEDIATE");
  await db.q(`INSERT OR IGNORE INTO node_keys VALUES (${lit(client_id)}, ${lit(endpoint)}, ${lit(idem_key)},
    ${lit(fp)}, 'in_progress', NULL, ${Date.now()}, ${lit(owner)})`);
  const [row] = await db.q(`SELECT fp, state, answer, owner FROM node_keys WHERE ${scope}`);
  await db.q("COMMIT");
  if (row.owner !== owner) {
    db.end();
    if (row.fp !== fp) say(422, false, "the key was used for another body", null);
    if (row.state !== "completed") say(409, false, "in_progress", null);
    const first = JSON.parse(row.answer);
    say(first.status, true, first.reason, first.body);
  }
  if (crash) fail(4, "crashed after the claim, on purpose");

  await db.q("BEGIN IMMEDIATE");
  const balance = async (id) => (await db.q(`SELECT balance FROM account WHERE acct_id = ${lit(id)}`))[0]?.balance;
  const have = await balance(body.src);
  const there = await balance(body.dst);
  let answer;
  if (have === undefined || there === undefined) answer = { status: 404, reason: "unknown account", body: null };
  else if (have < body.amount) answer = { status: 402, reason: "insufficient funds", body: null };
  else {
    const now = new Date().toISOString();
    await db.q(`INSERT INTO transfer (src, dst, amount, currency, created_at)
      VALUES (${lit(body.src)}, ${lit(body.dst)}, ${body.amount}, 'KRW', ${lit(now)})`);
    const [{ id }] = await db.q("SELECT last_insert_rowid() AS id");
    await db.q(`UPDATE account SET balance = balance - ${body.amount} WHERE acct_id = ${lit(body.src)}`);
    await db.q(`UPDATE account SET balance = balance + ${body.amount} WHERE acct_id = ${lit(body.dst)}`);
    const t = { transfer_id: id, src: body.src, dst: body.dst, amount: body.amount, currency: "KRW", created_at: now };
    answer = { status: 201, reason: null, body: t };
  }
  await db.q(`UPDATE node_keys SET state = 'completed', answer = ${lit(JSON.stringify(answer))} WHERE ${scope}`);
  await db.q("COMMIT");
  db.end();
  say(answer.status, false, answer.reason, answer.body);
}

main().catch((e) => fail(1, `failed: ${e.message}`));
