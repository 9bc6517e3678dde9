//! `idem`: the harness around the engine. Each subcommand is a thin call
//! into the library; exit 0 on success, 1 with one line on stderr otherwise.

use clap::{Parser, Subcommand};
use idem::clock::{self, Timestamp};
use idem::harness::HarnessError;
use idem::harness::day::{self, io_at};
use idem::policy::Policy;
use idem::protocol;
use idem::request::ScopedKey;
use idem::store::{self, Db, Usage};
use serde_json::json;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::ExitCode;

/// Generate a day of transfer traffic, measure what the naive system paid
/// twice, replay it through the engine, and prove nothing went out twice.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where payouts go.
#[derive(clap::Args, Debug)]
struct GatewayArgs {
    /// The gateway's base URL (POST /payouts, GET /payouts/{key}), e.g. one `idem gateway`.
    #[arg(long, value_name = "URL", value_parser = idem::payout::gateway_url)]
    gateway: Option<String>,
    /// Bearer token for the gateway (or IDEM_GATEWAY_TOKEN).
    #[arg(long, env = "IDEM_GATEWAY_TOKEN", hide_env_values = true)]
    gateway_token: Option<String>,
    /// Each call's whole time; past it the payout's outcome is unknown.
    #[arg(long, default_value = "10s", value_parser = clock::parse_positive_duration)]
    gateway_timeout: std::time::Duration,
    /// The gateway's lookups may miss a payout younger than this.
    #[arg(long, default_value = "0ms", value_parser = clock::parse_duration)]
    gateway_lookup_delay: std::time::Duration,
    /// The gateway forgets a key after this (Stripe: 24h; Toss Payments: 15d).
    #[arg(long, default_value = "24h", value_parser = clock::parse_duration)]
    gateway_key_window: std::time::Duration,
    /// A resend stays this far inside the key window (clock skew; the call's
    /// own time is kept on top of it).
    #[arg(long, default_value = "1h", value_parser = clock::parse_duration)]
    gateway_key_margin: std::time::Duration,
    /// At most this many sends of one payout, the first included; then it
    /// waits for a person (`idem payouts`).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i64).range(1..=1000))]
    gateway_max_sends: i64,
    /// The first wait before an unknown payout is looked at again; it
    /// doubles per look (with full jitter) up to --gateway-backoff-cap.
    #[arg(long, default_value = "30s", value_parser = clock::parse_duration)]
    gateway_backoff: std::time::Duration,
    #[arg(long, default_value = "1h", value_parser = clock::parse_duration)]
    gateway_backoff_cap: std::time::Duration,
    /// A paid payout is looked up again for this long after it was paid, to
    /// learn of money that came back (returned, reversed); 0s: never.
    #[arg(long, default_value = "72h", value_parser = clock::parse_duration)]
    gateway_return_window: std::time::Duration,
    /// How often a paid payout is looked up within the return window.
    #[arg(long, default_value = "6h", value_parser = clock::parse_positive_duration)]
    gateway_return_check: std::time::Duration,
}

impl GatewayArgs {
    fn http(self) -> Option<idem::payout::HttpGateway> {
        Some(idem::payout::HttpGateway {
            url: self.gateway?,
            token: self.gateway_token,
            timeout: self.gateway_timeout,
            limits: idem::payout::Limits {
                lookup_delay: self.gateway_lookup_delay,
                key_window: self.gateway_key_window,
                key_margin: self.gateway_key_margin,
                max_sends: self.gateway_max_sends,
                backoff: self.gateway_backoff,
                backoff_cap: self.gateway_backoff_cap,
                return_window: self.gateway_return_window,
                return_check: self.gateway_return_check,
            },
        })
    }
}

#[derive(Subcommand, Debug)]
enum PayoutsAction {
    /// One JSON line per payout: by default every one not settled, oldest first.
    List {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        /// Only payouts in this state (in_progress, unknown, needs_attention,
        /// completed, failed, returned).
        #[arg(long, value_parser = payout_state)]
        state: Option<idem::store::PayoutState>,
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
    },
    /// Provider events that moved no money and need a person (for no payout
    /// of ours, or with another amount or currency), one JSON line each.
    Strays {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
    },
    /// One payout and its audit trail (who changed its state, when, why), as JSON.
    Show {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        id: i64,
    },
    /// Settle a payout that is not settled by what the provider says: paid
    /// (with the provider's reference) or failed (the hold goes back to its
    /// account). One transaction with an audit row. Refused while a request
    /// or a reconciler holds the payout, and for a settled one (exit 1).
    Settle {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        id: i64,
        /// The provider paid it.
        #[arg(long, conflicts_with = "failed", requires = "reference")]
        paid: bool,
        /// The provider's reference for the payment.
        #[arg(long, requires = "paid")]
        reference: Option<String>,
        /// It was not paid and will not be.
        #[arg(long, required_unless_present = "paid")]
        failed: bool,
        /// Why: kept in the audit trail (and, for --failed, the client's reason).
        #[arg(long)]
        reason: String,
        /// Who settles it (default: $USER).
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
    },
}

fn payout_state(text: &str) -> Result<idem::store::PayoutState, String> {
    idem::store::PayoutState::parse(text).map_err(|_| {
        let names: Vec<&str> = idem::store::PayoutState::ALL.iter().map(|s| s.name()).collect();
        format!("one of {}", names.join(", "))
    })
}

/// A payout as `idem payouts` prints it: everything a person needs.
fn payout_line(p: &idem::store::PayoutRow) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_str(&idem::payout::to_json(p)).unwrap_or_default();
    v["client_id"] = json!(p.key.client_id);
    v["idem_key"] = json!(p.key.idem_key);
    v["downstream_key"] = json!(p.downstream_key);
    v["sends"] = json!(p.sends);
    v["attempts"] = json!(p.attempts);
    v["updated_at"] = json!(p.updated_at.to_string());
    v["next_look"] = json!(p.lease_until.to_string());
    v["holder"] = json!(p.holder);
    v["note"] = json!(p.note);
    v
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The day: gen, dup-report and replay into DIR, plus policy.json and idem_report.md.
    ///
    /// The same-instant requests are also raced as real engine processes on
    /// a copy of the day: the idem_api next to this binary, or `idem api`.
    Prove {
        #[arg(long, default_value = "out")]
        out: PathBuf,
        /// The engine command to race with (the lab's --db/--request contract).
        #[arg(long, value_name = "CMD")]
        engine: Option<String>,
        /// Replay the day into this empty PostgreSQL database instead of DIR/day.db.
        #[arg(long, value_name = "POSTGRES_URL", value_parser = db)]
        db: Option<Db>,
    },
    /// Write idem.db: 8 accounts, 120 logged requests (100 keys), the naive transfers.
    Gen {
        #[arg(long, default_value = "out/idem.db")]
        out: PathBuf,
    },
    /// Count the transfers the naive system made twice (dup_report.json).
    DupReport {
        #[arg(long, default_value = "out/idem.db")]
        db: PathBuf,
        /// Where to write the report; "-" for standard output.
        #[arg(long, default_value = "out/dup_report.json")]
        out: PathBuf,
    },
    /// Send every logged request through the engine into a new day database (result.json).
    Replay {
        #[arg(long, default_value = "out/idem.db")]
        log: PathBuf,
        /// A SQLite file that must not exist, or an empty PostgreSQL database.
        #[arg(long, default_value = "out/day.db", value_parser = db)]
        db: Db,
        /// Where to write the result; "-" for standard output.
        #[arg(long, default_value = "out/result.json")]
        out: PathBuf,
    },
    /// Run scenario files (scenarios/*.scn) step by step; stops at the first mismatch.
    Scenario {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// List claims still in progress (live or stale) as JSON lines; --release deletes the stale ones.
    ///
    /// A stale claim is one whose lease has run out: its process died before
    /// moving money, so releasing it lets the next retry start afresh.
    /// IDEM_NOW=<RFC 3339> fixes the clock.
    Recover {
        /// With --release: release live claims too, for holders known gone (a
        /// killed database backend, a server that died). Safe for money: a
        /// holder still running finds its claim gone, moves nothing and
        /// answers 409, and its retry executes afresh.
        #[arg(long, requires = "release")]
        force_live: bool,
        /// SQLite file or PostgreSQL connection string (or IDEM_DB, which keeps a password out of the process list).
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        /// Delete the stale claims: a line per released key, then {"released": N}.
        #[arg(long)]
        release: bool,
    },
    /// Delete the keys past retention, in short batches; prints {"purged": N}.
    ///
    /// Unlike `idem_api --purge-before`, this never deletes a key that a
    /// retry could still need. Each batch is its own transaction, so live
    /// traffic waits for the write lock at most one batch at a time.
    /// IDEM_NOW=<RFC 3339> fixes the clock.
    Purge {
        /// SQLite file or PostgreSQL connection string (or IDEM_DB, which keeps a password out of the process list).
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        /// Keys deleted per transaction.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
        batch: u64,
    },
    /// Serve the protocol over HTTP (draft-ietf-httpapi-idempotency-key-header).
    ///
    /// POST /v1/transfers with `Authorization: Bearer TOKEN` and an
    /// `Idempotency-Key` header; GET /v1/transfers/{id}, /healthz, /metrics,
    /// /openapi.json. Prints `http://HOST:PORT` first; logs one JSON line per
    /// request on stderr (never waiting for it: lines a full stderr cannot
    /// take are dropped and counted in /metrics); SIGTERM or Ctrl-C drains
    /// and exits 0. IDEM_LOG_SECRET keys the logged key tags (default: a
    /// random secret per process). IDEM_NOW=<RFC 3339> fixes the clock (for
    /// tests).
    Serve {
        /// SQLite file or PostgreSQL connection string, the same key space as idem_api (or IDEM_DB, which keeps a password out of the process list).
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        /// Address to listen on; port 0 picks a free one.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// JSON object mapping each bearer token to its client id.
        #[arg(long, value_name = "FILE")]
        clients: PathBuf,
        /// Connections to PostgreSQL (SQLite always uses one writer).
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
        pool: u16,
        /// Transfers answered at once; more get 503 busy at once.
        #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
        max_in_flight: u32,
        /// Connections served at once; more wait in the kernel's backlog (default: sized to the descriptor limit).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        max_connections: Option<u32>,
        /// SQLite: the most transfers one group commit (one fsync) carries; 1 commits each alone.
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
        group_max: u32,
        /// With --gateway: POST /v1/payouts pays out through it (see docs/payouts.md).
        #[command(flatten)]
        gateway: GatewayArgs,
        /// How often payouts left unknown or stranded are reconciled (with --gateway).
        #[arg(long, default_value = "30s", value_parser = clock::parse_positive_duration)]
        reconcile_every: std::time::Duration,
        /// Payouts answered at once, apart from --max-in-flight (a quarter of
        /// them per client); more get 503 busy at once.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
        max_payouts_in_flight: u32,
        /// With --gateway: POST /v1/gateway-events takes the provider's events
        /// signed with this secret (HMAC-SHA256; see docs/payouts.md).
        #[arg(long, env = "IDEM_GATEWAY_EVENTS_SECRET", hide_env_values = true)]
        gateway_events_secret: Option<String>,
    },
    /// Settle payouts left unknown (or stranded in progress past their lease) by asking the gateway.
    ///
    /// Each is looked up by its downstream key: paid → completed (the answer
    /// the client would have got is stored); failed → the hold goes back to
    /// its account; pending → left; not found → sent again with the same key,
    /// only after the gateway's lookup delay and inside its key window, else
    /// left for a person. One JSON line per decision. Two reconcilers at once
    /// never work on one payout. --list prints the payouts not settled.
    Reconcile {
        /// SQLite file or PostgreSQL connection string (or IDEM_DB).
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        #[command(flatten)]
        gateway: GatewayArgs,
        /// Only list the payouts not settled, one JSON line each; change nothing.
        #[arg(long)]
        list: bool,
    },
    /// The payouts a person settles: list them, show one with its audit
    /// trail, settle one by what the provider says (docs/payouts.md, the runbook).
    Payouts {
        #[command(subcommand)]
        action: PayoutsAction,
    },
    /// A payment gateway to pay out through, with seeded faults (a test harness).
    ///
    /// POST /payouts with an Idempotency-Key and {"beneficiary", "amount",
    /// "currency"}: 201 paid, 402 account_closed (a beneficiary named
    /// closed-...), 422 amount_over_limit; a retry with the same key and
    /// body gets the payout's latest state (409 while pending), another body
    /// 400 idempotency_key_reused. GET /payouts/{key}: the payout (pending,
    /// paid, failed) or 404. Keys are forgotten after --key-window: a key
    /// sent again after it pays again. Every decision is committed to the
    /// ledger (--db, table payout) before it is answered; the faults lose or
    /// garble answers, never the ledger. Prints its URL once listening.
    Gateway {
        /// The gateway's own ledger, a SQLite file (created if absent).
        #[arg(long)]
        db: PathBuf,
        /// Address to listen on; port 0 picks a free one.
        #[arg(long, default_value = "127.0.0.1:8090")]
        listen: String,
        /// Seed of the fault draws (in arrival order).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Percent of payout requests closed unanswered and unrecorded.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        lose_request: u64,
        /// Percent recorded, then closed unanswered.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        drop_answer: u64,
        /// Percent recorded, then answered 500.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        error_5xx: u64,
        /// Percent recorded pending and settled only after --slow-for.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        slow: u64,
        /// How long a slow payout stays pending (answered when settled).
        #[arg(long, default_value = "5s", value_parser = clock::parse_duration)]
        slow_for: std::time::Duration,
        /// Lookups answer 404 for a payout younger than this.
        #[arg(long, default_value = "0ms", value_parser = clock::parse_duration)]
        lookup_delay: std::time::Duration,
        /// How long a key is remembered (Stripe: 24 h; Toss Payments: 15 days).
        #[arg(long, default_value = "1d", value_parser = clock::parse_duration)]
        key_window: std::time::Duration,
        /// Payouts above this amount are refused, 422 amount_over_limit.
        #[arg(long, default_value_t = 1_000_000_000, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
        /// Require Authorization: Bearer TOKEN (or IDEM_GATEWAY_TOKEN).
        #[arg(long, env = "IDEM_GATEWAY_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Percent answered 403 forbidden, nothing recorded (no resend can fix it).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        refuse_4xx: u64,
        /// Percent refused (402) with a poisoned reason: a NUL, line breaks, 2 000 characters.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        poison: u64,
        /// Percent of paid payouts returned --return-after later (the money comes back).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        returns: u64,
        #[arg(long, default_value = "2s", value_parser = clock::parse_duration)]
        return_after: std::time::Duration,
        /// Percent of events (to the endpoint POST /webhook_endpoints registers) never sent.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        event_loss: u64,
        /// Percent of events sent twice.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
        event_dup: u64,
    },
    /// Send one transfer over HTTP, retrying until a final answer or the budget runs out.
    ///
    /// One key for every attempt (new, given, or kept in --key-file, written
    /// and synced before the first attempt so a crashed client resumes with
    /// it); exponential backoff with full jitter; retries timeouts, lost
    /// connections, 409, 429, 503 and other 5xx (after a 429's or 503's
    /// Retry-After). Once an attempt may have reached the server, only the
    /// transfer's own stored answer is final (2xx, or a 402/404/422 naming a
    /// stored reason); any other refusal then means the outcome is unknown.
    /// Exit 0: the transfer exists (its JSON on stdout). Exit 4: refused for
    /// good (the problem on stdout). Exit 75: outcome unknown, retry with the
    /// same key. Exit 1: the key or key file cannot be used, or the token
    /// file cannot be read. Exit 2: usage.
    Transfer {
        /// The service's base URL, e.g. http://127.0.0.1:8080. Repeat it for
        /// several instances of one service: each retry goes to the next.
        #[arg(long, required = true)]
        url: Vec<String>,
        /// Bearer token (visible to other users in the process list: prefer --token-file or IDEM_TOKEN).
        #[arg(long, env = "IDEM_TOKEN", hide_env_values = true, conflicts_with = "token_file")]
        token: Option<String>,
        /// A file holding the bearer token (its first line).
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
        /// Source account (an integer id if it parses as one).
        #[arg(long)]
        src: String,
        /// Destination account.
        #[arg(long)]
        dst: String,
        /// In the currency's smallest unit.
        #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
        amount: i64,
        #[arg(long, default_value = "KRW")]
        currency: String,
        /// The idempotency key: 1 to 255 printable ASCII characters (default: a new UUID, or the one in --key-file).
        #[arg(long, conflicts_with = "key_file")]
        key: Option<String>,
        /// Keep the key in this file: read it if present, else publish a new one there first.
        #[arg(long)]
        key_file: Option<PathBuf>,
        /// The whole time allowed, attempts and pauses: e.g. 30s, 500ms, 2m.
        #[arg(long, default_value = "30s", value_parser = clock::parse_duration)]
        budget: std::time::Duration,
    },
    /// A day of concurrent clients through a lossy network to a real idem serve, killed mid-day.
    ///
    /// Each client sends its own transfers with the retrying client, through
    /// a fault-injecting proxy (dropped requests and answers, cut answers,
    /// delays, duplicates); the server is SIGKILLed and restarted --kills
    /// times (and the database restarted by --restart-db). With --instances
    /// N, N servers share the database and each client tries them in turn;
    /// --failover N runs --failover-cmd N times (a replicated PostgreSQL's
    /// primary killed). The verdict, from the database and the clients'
    /// logs, goes to DIR/chaos.json and DIR/chaos_report.md; exit 1 if
    /// anything went out twice or was lost, or a key was left claimed.
    Chaos {
        #[arg(long, default_value = "out/chaos")]
        out: PathBuf,
        /// Seeds the fault plan and the clients (default: the clock; printed).
        #[arg(long)]
        seed: Option<u64>,
        /// An empty PostgreSQL database (default: a new SQLite file in DIR).
        #[arg(long, value_parser = db)]
        db: Option<Db>,
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=512))]
        clients: u16,
        /// Transfers per client.
        #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u32).range(1..))]
        transfers: u32,
        /// Server kills (default: 2 with one instance, else 0).
        #[arg(long)]
        kills: Option<u16>,
        /// Servers running at once on the one database.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
        instances: u16,
        /// How many times the database's primary is killed (--failover-cmd),
        /// evenly spaced over the day.
        #[arg(long, default_value_t = 0)]
        failover: u16,
        /// Kills the primary; returns once it is dead.
        #[arg(long, value_name = "CMD", default_value = "tools/pg-ha kill-primary")]
        failover_cmd: String,
        /// Then runs until the cluster is whole again (a new primary, the old one a standby).
        #[arg(long, value_name = "CMD", default_value = "tools/pg-ha heal")]
        heal_cmd: String,
        /// The server command (default: this binary's `serve`); --db, --listen, --clients are appended.
        #[arg(long, value_name = "CMD")]
        serve: Option<String>,
        /// A command that restarts the database once, half way (e.g. `tools/pg-local restart`).
        #[arg(long, value_name = "CMD")]
        restart_db: Option<String>,
        /// Each client's time budget per transfer.
        #[arg(long, default_value = "20s", value_parser = clock::parse_duration)]
        budget: std::time::Duration,
        /// Each client's pause between two transfers, to stretch the day.
        #[arg(long, default_value = "0ms", value_parser = clock::parse_duration)]
        think: std::time::Duration,
        /// Every fourth intent is a payout through an `idem gateway` that
        /// loses 5% of requests, drops 10% of answers, answers 5% with 500
        /// and is slow on 5% (2 s, past idem's 1 s timeout); the verdict
        /// reads its ledger too.
        #[arg(long)]
        payouts: bool,
    },
    /// Judge any implementation of the same job: one line per property, PASS, FAIL or SKIP.
    ///
    /// --engine "CMD …": a program of the lab's contract (CMD --db DB
    /// --request REQ [--crash-after-claim], CMD --db DB --purge-before T),
    /// run on databases this check builds with its own random accounts,
    /// amounts and keys. CMD is split as a shell would (quote a path with a
    /// space); --engine-arg adds one argument as it is.
    ///
    /// --url URL --token T [--token T2]: an HTTP service, judged by the IETF
    /// draft and DESIGN §2.
    ///
    /// --profile FILE: what the implementation chose where the contract
    /// leaves it open (JSON; see docs/check.md). Without one, idem's choices
    /// for --url, and for --engine any stable 4xx of the right class.
    /// Each FAIL names the sentence of the contract it rests on and shows
    /// the steps. Exit 1 on any failure; --seed reproduces a run's plan
    /// (its keys are fresh each run).
    Check {
        #[arg(long, value_name = "CMD", required_unless_present = "url", conflicts_with = "url")]
        engine: Option<String>,
        /// One more argument for the engine, taken as it is (repeatable).
        #[arg(long, value_name = "ARG", requires = "engine", allow_hyphen_values = true)]
        engine_arg: Vec<String>,
        #[arg(long)]
        url: Option<String>,
        /// Bearer token(s): two of distinct clients check the scope.
        #[arg(long, requires = "url")]
        token: Vec<String>,
        /// Two accounts the service holds, the first with funds to spare.
        #[arg(long, default_value = "A", requires = "url")]
        src: String,
        #[arg(long, default_value = "B", requires = "url")]
        dst: String,
        #[arg(long)]
        profile: Option<PathBuf>,
        #[arg(long)]
        seed: Option<u64>,
    },
    /// The idem_api contract itself (`idem api --db DB --request REQ`).
    #[command(hide = true)]
    Api {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

/// Why a command failed: one line on stderr, exit 1.
#[derive(Debug)]
struct Failure(String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<HarnessError> for Failure {
    fn from(e: HarnessError) -> Self {
        Failure(e.0)
    }
}

impl From<idem::store::StoreError> for Failure {
    fn from(e: idem::store::StoreError) -> Self {
        Failure(format!("store: {e}"))
    }
}

fn main() -> ExitCode {
    match run(Cli::parse().command, Policy::embedded()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem: {e}");
            ExitCode::FAILURE
        }
    }
}

fn payouts(action: PayoutsAction, policy: &'static Policy) -> Result<ExitCode, Failure> {
    use idem::payout;
    let open = |db: &Db| -> Result<Box<dyn idem::store::Store>, Failure> {
        let mut store = store::open(db, policy, Usage::LongLived)?;
        payout::prepare(&mut *store, policy)?;
        Ok(store)
    };
    match action {
        PayoutsAction::List { db, state, limit } => {
            for p in payout::listed(&mut *open(&db)?, state, limit, policy)? {
                println!("{}", payout_line(&p));
            }
        }
        PayoutsAction::Strays { db, limit } => {
            for e in payout::stray_events(&mut *open(&db)?, limit, policy)? {
                println!(
                    "{}",
                    json!({"event_id": e.event_id, "received_at": e.received_at, "type": e.kind,
                           "downstream_key": e.downstream_key, "outcome": e.outcome})
                );
            }
        }
        PayoutsAction::Show { db, id } => {
            let Some((p, events)) = payout::events(&mut *open(&db)?, id, policy)? else {
                return Err(Failure(format!("no payout {id}")));
            };
            let mut v = payout_line(&p);
            v["events"] = events
                .iter()
                .map(|e| json!({"at": e.at.to_string(), "actor": e.actor, "was": e.was.name(), "now": e.now.name(), "why": e.why}))
                .collect();
            println!("{v}");
        }
        PayoutsAction::Settle { db, id, paid, reference, failed: _, reason, by } => {
            let finding = match (paid, reference) {
                (true, Some(reference)) => payout::Finding::Paid { reference },
                _ => payout::Finding::Failed,
            };
            match payout::settle_by_hand(&mut *open(&db)?, id, &finding, &reason, &by, now()?, policy)? {
                Ok(p) => println!("{}", payout_line(&p)),
                Err(why) => return Err(Failure(why)),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn run(command: Command, policy: &'static Policy) -> Result<ExitCode, Failure> {
    match command {
        Command::Gen { out } => {
            make_parent(&out)?;
            day::generate_at(&out)?;
            println!("wrote {}", out.display());
        }
        Command::DupReport { db, out } => {
            let report = day::report::dup_report(&day::open_existing(&db)?)?;
            emit(&out, &day::to_json(&report)?)?;
        }
        Command::Replay { log, db, out } => {
            if let Some(path) = db.path() {
                make_parent(path)?;
            }
            let replayed = day::replay_at(&log, &db, policy, None)?;
            emit(&out, &day::to_json(&replayed.result)?)?;
        }
        Command::Scenario { files } => {
            for file in files {
                let text = std::fs::read_to_string(&file)
                    .map_err(|e| Failure(format!("cannot read {}: {e}", file.display())))?;
                let outcome = idem::harness::scenario::parse(&text)
                    .and_then(|s| idem::harness::scenario::run(&s, policy));
                println!("== {}", file.display());
                match outcome {
                    Ok(transcript) => println!("{transcript}ok"),
                    Err(failure) => {
                        print!("{}", failure.transcript);
                        return Err(Failure(format!(
                            "{} line {}: {}",
                            file.display(),
                            failure.line,
                            failure.message
                        )));
                    }
                }
            }
        }
        Command::Reconcile { db, gateway, list } => {
            let mut store = store::open(&db, policy, Usage::LongLived)?;
            idem::payout::prepare(&mut *store, policy)?;
            if list {
                for p in idem::payout::open(&mut *store, now()?, policy)? {
                    println!(
                        "{}",
                        json!({"payout_id": p.id, "downstream_key": p.downstream_key, "state": p.state.name(),
                               "amount": p.amount, "created_at": p.created_at.to_string(), "note": p.note})
                    );
                }
                return Ok(ExitCode::SUCCESS);
            }
            let gateway = gateway.http().ok_or_else(|| Failure("give --gateway URL (or --list)".into()))?;
            let fixed = fixed_now()?;
            let clock = move || fixed.unwrap_or_else(Timestamp::now);
            for d in idem::payout::reconcile(&mut *store, &gateway, &clock, policy)? {
                println!("{}", d.to_json());
            }
        }
        Command::Payouts { action } => return payouts(action, policy),
        Command::Recover { db, release, force_live } => {
            let now = now()?;
            let mut store = store::open(&db, policy, Usage::LongLived)?;
            let line = |state: &str, k: &ScopedKey, created_at: Timestamp, lease_until: Timestamp| {
                let (created_at, lease_until) = (created_at.to_string(), lease_until.to_string());
                json!({"state": state, "client_id": k.client_id, "endpoint": k.endpoint, "idem_key": k.idem_key,
                       "created_at": created_at, "lease_until": lease_until})
            };
            let claims = protocol::open_claims(&mut store, now, policy)?;
            if release {
                if force_live {
                    let live = claims.iter().filter(|c| !c.stale).count();
                    eprintln!(
                        "idem: releasing {live} live claim(s) too: a request still running under one \
                         finds its claim gone, moves no money and answers 409; its retry executes afresh"
                    );
                }
                let released = protocol::release_claims(&mut store, now, force_live, policy)?;
                for c in claims.iter().filter(|c| released.contains(&c.key)) {
                    println!("{}", line("released", &c.key, c.created_at, c.lease_until));
                }
                println!("{}", json!({"released": released.len()}));
            } else {
                for c in &claims {
                    println!(
                        "{}",
                        line(if c.stale { "stale" } else { "live" }, &c.key, c.created_at, c.lease_until)
                    );
                }
            }
        }
        Command::Purge { db, batch } => {
            let now = now()?;
            let mut store = store::open(&db, policy, Usage::LongLived)?;
            let purged = protocol::purge_expired(&mut store, now, batch, policy)?;
            println!("{}", json!({"purged": purged}));
        }
        Command::Gateway {
            db,
            listen,
            seed,
            lose_request,
            drop_answer,
            error_5xx,
            slow,
            slow_for,
            lookup_delay,
            key_window,
            limit,
            token,
            refuse_4xx,
            poison,
            returns,
            return_after,
            event_loss,
            event_dup,
        } => {
            let faults = idem::harness::gateway::Faults {
                lose_request,
                drop_answer,
                error_5xx,
                slow,
                refuse_4xx,
                poison,
                returns,
                event_loss,
                event_dup,
            };
            if lose_request + drop_answer + error_5xx + slow + refuse_4xx + poison > 100 {
                return Err(Failure("the fault percentages add up to more than 100".into()));
            }
            let listener = std::net::TcpListener::bind(&listen)
                .map_err(|e| Failure(format!("cannot listen on {listen}: {e}")))?;
            let address =
                listener.local_addr().map_err(|e| Failure(format!("cannot listen on {listen}: {e}")))?;
            let options = idem::harness::gateway::Options {
                db,
                seed,
                faults,
                slow_for,
                lookup_delay,
                key_window,
                limit,
                token,
                return_after,
            };
            // the ledger is opened before the URL is printed: a caller that
            // read the URL can pay at once
            let ledger = idem::harness::gateway::open(&options.db).map_err(|e| Failure(e.to_string()))?;
            drop(ledger);
            println!("http://{address}");
            use std::io::Write;
            let _ = std::io::stdout().flush();
            idem::harness::gateway::serve(listener, options).map_err(|e| Failure(e.to_string()))?;
        }
        Command::Serve {
            db,
            listen,
            clients,
            pool,
            max_in_flight,
            max_connections,
            group_max,
            gateway,
            reconcile_every,
            max_payouts_in_flight,
            gateway_events_secret,
        } => {
            let descriptors = idem::service::descriptor_limit();
            let options = idem::service::Options {
                db,
                clients: idem::service::load_clients(&clients, policy).map_err(|e| Failure(e.to_string()))?,
                pool: usize::from(pool),
                max_in_flight: max_in_flight as usize,
                max_connections: max_connections
                    .map_or_else(|| idem::service::default_max_connections(descriptors), |n| n as usize),
                group_max: group_max as usize,
                log_secret: std::env::var_os("IDEM_LOG_SECRET").map(|s| s.into_encoded_bytes()),
                gateway: gateway.http(),
                reconcile_every,
                max_payouts_in_flight: max_payouts_in_flight as usize,
                events_secret: gateway_events_secret.map(String::into_bytes),
            };
            let clock: idem::service::executor::Clock = match fixed_now()? {
                Some(fixed) => std::sync::Arc::new(move || fixed),
                None => std::sync::Arc::new(Timestamp::now),
            };
            let listener = std::net::TcpListener::bind(&listen)
                .map_err(|e| Failure(format!("cannot listen on {listen}: {e}")))?;
            let address =
                listener.local_addr().map_err(|e| Failure(format!("cannot listen on {listen}: {e}")))?;
            let service = match idem::service::Service::start(
                options,
                Box::new(std::io::stderr()),
                policy,
                clock,
                None,
            ) {
                Ok(service) => service,
                // as idem_api: a database that cannot be used is exit 5
                Err(e @ idem::service::ServeError::Database(_)) => {
                    eprintln!("idem: {e}");
                    return Ok(ExitCode::from(5));
                }
                Err(e) => return Err(Failure(e.to_string())),
            };
            // The first line names the bound address (port 0 picks one), once
            // the stores are open: a client that reads it can send at once.
            println!("http://{address}");
            std::io::Write::flush(&mut std::io::stdout()).map_err(|e| Failure(format!("stdout: {e}")))?;
            service.run(listener, idem::service::shutdown_signal()).map_err(|e| Failure(e.to_string()))?;
        }
        Command::Transfer { url, token, token_file, src, dst, amount, currency, key, key_file, budget } => {
            let token = secret(token, token_file.as_deref(), "--token or --token-file (or IDEM_TOKEN)")?;
            return transfer(url, token, [src, dst], amount, currency, key, key_file, budget, policy);
        }
        Command::Chaos {
            out,
            seed,
            db,
            clients,
            transfers,
            kills,
            instances,
            failover,
            failover_cmd,
            heal_cmd,
            serve,
            restart_db,
            budget,
            think,
            payouts,
        } => {
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
            let me = own_path()?.to_string_lossy().into_owned();
            let serve = match serve {
                Some(cmd) => cmd.split_whitespace().map(String::from).collect(),
                None => vec![me.clone(), "serve".into()],
            };
            let shell = |cmd: String| -> idem::harness::chaos::Command {
                Box::new(move || {
                    // its output goes to stderr: stdout is the day's summary
                    let stdout = std::io::stderr().as_fd().try_clone_to_owned().map_err(|e| e.to_string())?;
                    let status = std::process::Command::new("sh").args(["-c", &cmd]).stdout(stdout).status();
                    match status {
                        Ok(s) if s.success() => Ok(()),
                        other => Err(format!("{cmd}: {other:?}")),
                    }
                })
            };
            let kills = kills.unwrap_or(if instances == 1 { 2 } else { 0 });
            if kills > 0 && instances > 1 {
                return Err(Failure(
                    "--kills needs --instances 1: the claims a killed server leaves are released by \
                     `idem recover`, which cannot tell them from the live instances' claims"
                        .into(),
                ));
            }
            let config = idem::harness::chaos::Config {
                out: out.clone(),
                seed,
                db,
                clients: usize::from(clients),
                transfers: transfers as usize,
                serve,
                instances: usize::from(instances),
                kills: usize::from(kills),
                restart_db: restart_db.map(shell),
                failovers: usize::from(failover),
                failover: (failover > 0).then(|| [shell(failover_cmd), shell(heal_cmd)]),
                budget,
                think,
                odds: idem::harness::proxy::Odds::default(),
                gateway: payouts.then(|| {
                    let faults = [
                        ["--lose-request", "5", "--drop-answer", "10", "--error-5xx", "5", "--slow", "5"],
                        ["--refuse-4xx", "3", "--poison", "3", "--returns", "10", "--return-after", "1s"],
                    ];
                    let faults =
                        [&faults.concat()[..], &["--event-loss", "10", "--event-dup", "20"]].concat();
                    let seed = seed.to_string();
                    [&[me.as_str(), "gateway", "--slow-for", "2s", "--seed", &seed][..], &faults[..]]
                        .concat()
                        .into_iter()
                        .map(String::from)
                        .collect()
                }),
            };
            let s = idem::harness::chaos::run(config, policy)?;
            println!(
                "seed {seed}: {} transfers intended, {} made; paid twice {}, lost {}, unintended {}; \
                 {} requests, {} dropped, {} answers dropped, {} cut, {} duplicated; {} kills, {} failovers \
                 ({} not run: the day had ended); {} unknown, {} keys left claimed",
                s.transfers_intended,
                s.transfers_made,
                s.transfers_paid_twice,
                s.transfers_lost,
                s.transfers_unintended,
                s.requests_sent,
                s.requests_dropped,
                s.responses_dropped,
                s.responses_cut,
                s.requests_duplicated,
                s.server_kills,
                s.failovers.len(),
                s.failovers_not_run,
                s.outcomes_unknown,
                s.keys_left_claimed
            );
            for f in &s.failovers {
                println!(
                    "failover at {} ms: writes resumed after {}, {} answered 503, {} commits whose answer was lost found by the retry",
                    f.at_ms,
                    f.writes_resumed_ms.map_or("(not before the next)".into(), |ms| format!("{ms} ms")),
                    f.answered_503,
                    f.acks_lost_found_by_retry
                );
            }
            if let Some(p) = &s.payouts {
                println!(
                    "payouts: {} intended, {} completed, {} failed, {} returned after paid ({} at the gateway), \
                     {} left for a person; sends per payout median {} max {}; made twice {}, \
                     paid twice at the gateway {}, at the gateway without an intent {}, told paid but not paid {}, \
                     disagreements {}; {} settled by a reconciliation",
                    p.intended,
                    p.completed,
                    p.failed,
                    p.returned,
                    p.returned_at_gateway,
                    p.left_for_a_person.len(),
                    p.sends_median,
                    p.sends_max,
                    p.made_twice,
                    p.paid_twice_at_gateway,
                    p.at_gateway_without_intent,
                    p.told_but_not_paid,
                    p.disagreements,
                    p.settled_by_reconciliation
                );
            }
            println!("wrote {}", out.join("chaos.json").display());
            println!("wrote {}", out.join("chaos_report.md").display());
            if !s.exactly_once() {
                return Err(Failure("NOT exactly once: see chaos_report.md".into()));
            }
            if !s.passed() {
                return Err(Failure(format!(
                    "{} keys left claimed: see chaos_report.md",
                    s.keys_left_claimed
                )));
            }
        }
        Command::Check { engine, engine_arg, url, token, src, dst, profile, seed } => {
            use idem::harness::check::{self, engine as lab, url as http};
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
            fn read_profile<P: serde::de::DeserializeOwned + Default>(
                file: Option<PathBuf>,
            ) -> Result<P, Failure> {
                let Some(file) = file else { return Ok(P::default()) };
                let text = std::fs::read_to_string(&file).map_err(io_at(&file))?;
                serde_json::from_str(&text).map_err(|e| Failure(format!("{}: {e}", file.display())))
            }
            let passed = match (engine, url) {
                (Some(engine), _) => {
                    let command = lab::command(&engine, &engine_arg).map_err(Failure)?;
                    println!("idem check --engine {engine:?} --seed {seed}");
                    let target = lab::Engine { command, profile: read_profile(profile)?, seed };
                    check::report(&check::judge(&lab::PROPERTIES, &target))
                }
                (None, Some(url)) => {
                    println!("idem check --url {url} --seed {seed}");
                    let id = |s: String| s.parse::<i64>().map_or_else(|_| json!(s), |i| json!(i));
                    let target =
                        http::Target::new(&url, token, id(src), id(dst), read_profile(profile)?, seed)
                            .map_err(Failure)?;
                    check::report(&check::judge(&http::PROPERTIES, &target))
                }
                (None, None) => return Err(Failure("give --engine or --url".into())),
            };
            if !passed {
                return Err(Failure(format!("a property failed (rerun with --seed {seed})")));
            }
        }
        Command::Api { args } => return Ok(idem::api::main(std::iter::once("idem_api".into()).chain(args))),
        Command::Prove { out, engine, db } => {
            let engine = match engine {
                Some(cmd) => cmd.split_whitespace().map(String::from).collect(),
                None => own_engine()?,
            };
            let r = day::prove(&out, policy, &engine, db.as_ref())?;
            println!(
                "{} requests: {} created, {} replayed, {} rejected; {} transfers; \
                 blocked {} KRW of double payment; keys paid twice: {}",
                r.requests,
                r.created,
                r.replayed,
                r.rejected,
                r.transfers,
                r.double_paid_avoided,
                r.keys_paid_twice
            );
            for name in day::PROVE_FILES.iter().filter(|n| db.is_none() || **n != "day.db") {
                println!("wrote {}", out.join(name).display());
            }
            if db.is_some() {
                println!("the day's tables are in the --db database");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[allow(clippy::too_many_arguments)]
fn transfer(
    urls: Vec<String>,
    token: String,
    [src, dst]: [String; 2],
    amount: i64,
    currency: String,
    key: Option<String>,
    key_file: Option<PathBuf>,
    budget: std::time::Duration,
    engine: &Policy,
) -> Result<ExitCode, Failure> {
    use idem::client::{self, Verdict};
    let key = match (key, key_file) {
        (Some(key), _) => {
            client::check_key(&key, engine.max_field_chars).map_err(|e| Failure(format!("--key: {e}")))?;
            key
        }
        (None, Some(file)) => client::key_in_file(&file, engine.max_field_chars)
            .map_err(|e| Failure(format!("{}: {e}", file.display())))?,
        (None, None) => client::new_key().map_err(|e| Failure(format!("no randomness for a key: {e}")))?,
    };
    let id = |s: String| s.parse::<i64>().map_or_else(|_| json!(s), |i| json!(i));
    let body = json!({"src": id(src), "dst": id(dst), "amount": amount, "currency": currency}).to_string();
    eprintln!("idem: key {key}");
    let policy = client::Policy { budget, ..client::Policy::default() };
    let seed =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    let endpoints: Vec<client::Endpoint> =
        urls.into_iter().map(|url| client::Endpoint { url, token: token.clone() }).collect();
    let report = client::send(&endpoints, &key, &body, &policy, &mut idem::rng::Rng::new(seed));
    let (attempts, took) = (report.attempts(), report.took.as_secs_f64());
    Ok(match report.verdict {
        Verdict::Done { body, .. } => {
            println!("{body}");
            ExitCode::SUCCESS
        }
        Verdict::Refused { status, body } => {
            println!("{body}");
            eprintln!("idem: refused for good with {status} after {attempts} attempt(s); not retried");
            ExitCode::from(4)
        }
        Verdict::Unknown { last } => {
            eprintln!(
                "idem: outcome unknown after {attempts} attempt(s) in {took:.1}s (last: {last}); \
                 retry with key {key}: the transfer goes out at most once under it"
            );
            ExitCode::from(75)
        }
    })
}

/// A secret given inline (or by its environment variable) or in a file
/// (its first line), so that it need not appear in the process list.
fn secret(inline: Option<String>, file: Option<&std::path::Path>, what: &str) -> Result<String, Failure> {
    match (inline, file) {
        (Some(value), _) => Ok(value),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file).map_err(io_at(file))?;
            let value = text.lines().next().unwrap_or("").trim();
            match value.is_empty() {
                true => Err(Failure(format!("{}: the file is empty", file.display()))),
                false => Ok(value.to_owned()),
            }
        }
        (None, None) => Err(Failure(format!("give {what}"))),
    }
}

/// `IDEM_NOW`, the instant tests fix the clock at; `None` for the wall
/// clock. The only place this binary reads it.
fn fixed_now() -> Result<Option<Timestamp>, Failure> {
    match std::env::var("IDEM_NOW") {
        Ok(text) => Timestamp::parse(&text).map(Some).map_err(|e| Failure(format!("IDEM_NOW: {e}"))),
        Err(_) => Ok(None),
    }
}

/// The wall clock, or `IDEM_NOW` when set (for tests).
fn now() -> Result<Timestamp, Failure> {
    Ok(fixed_now()?.unwrap_or_else(Timestamp::now))
}

/// The engine to race: the `idem_api` built next to this binary, or this
/// binary's own `api` command (the same code) when only `idem` was built.
fn own_engine() -> Result<Vec<String>, Failure> {
    let me = own_path()?;
    let sibling = me.with_file_name("idem_api");
    Ok(match sibling.is_file() {
        true => vec![sibling.to_string_lossy().into_owned()],
        false => vec![me.to_string_lossy().into_owned(), "api".into()],
    })
}

/// `--db`: a SQLite path or a PostgreSQL connection string.
fn db(text: &str) -> Result<Db, String> {
    Ok(Db::parse(text))
}

fn own_path() -> Result<PathBuf, Failure> {
    std::env::current_exe().map_err(|e| Failure(format!("cannot find this program's own path: {e}")))
}

fn make_parent(path: &std::path::Path) -> Result<(), Failure> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|e| io_at(dir)(e).into())
        }
        _ => Ok(()),
    }
}

fn emit(out: &std::path::Path, json: &str) -> Result<(), Failure> {
    if out.as_os_str() == "-" {
        println!("{json}");
        Ok(())
    } else {
        make_parent(out)?;
        day::write_file(out, json)?;
        println!("wrote {}", out.display());
        Ok(())
    }
}
