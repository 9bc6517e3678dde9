//! `idem gateway`: the stand-in payment gateway (see `idem::outside::gateway`).

use crate::common::{Failure, announce, bind};
use idem::outside::gateway;
use idem::{clock, https};
use std::path::PathBuf;

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
#[derive(clap::Args, Debug)]
pub struct Gateway {
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
    /// Serve HTTPS, as real providers do, with a self-signed certificate of
    /// its own for localhost, 127.0.0.1, ::1 and the --listen host (written
    /// to --tls-cert-out for clients to trust: `idem --ca-file`), or with
    /// --tls-cert and --tls-key.
    #[arg(long)]
    tls: bool,
    /// With --tls: where to write the self-signed certificate (PEM).
    #[arg(long, requires = "tls", conflicts_with = "tls_cert")]
    tls_cert_out: Option<PathBuf>,
    /// With --tls: the certificate chain to serve (PEM) instead of one of its own.
    #[arg(long, requires_all = ["tls", "tls_key"])]
    tls_cert: Option<PathBuf>,
    /// With --tls-cert: its private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

/// The certificate `idem gateway --tls` serves.
fn identity(args: &Gateway, address: std::net::SocketAddr) -> Result<Option<https::Identity>, Failure> {
    if !args.tls {
        return Ok(None);
    }
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        return https::Identity::of_files(cert, key)
            .map(Some)
            .map_err(|e| Failure(format!("--tls-cert: {e}")));
    }
    let mut names: Vec<String> = ["localhost", "127.0.0.1", "::1"].map(String::from).into();
    if !address.ip().is_unspecified() && !names.contains(&address.ip().to_string()) {
        names.push(address.ip().to_string());
    }
    let identity =
        https::Identity::self_signed(&names).map_err(|e| Failure(format!("the certificate: {e}")))?;
    if let Some(out) = &args.tls_cert_out {
        std::fs::write(out, &identity.cert_pem).map_err(|e| Failure(format!("{}: {e}", out.display())))?;
    }
    Ok(Some(identity))
}

pub fn gateway(args: Gateway) -> Result<(), Failure> {
    let Gateway { lose_request, drop_answer, error_5xx, slow, refuse_4xx, poison, .. } = args;
    if lose_request + drop_answer + error_5xx + slow + refuse_4xx + poison > 100 {
        return Err(Failure("the fault percentages add up to more than 100".into()));
    }
    let faults = gateway::Faults {
        lose_request,
        drop_answer,
        error_5xx,
        slow,
        refuse_4xx,
        poison,
        returns: args.returns,
        event_loss: args.event_loss,
        event_dup: args.event_dup,
    };
    let (listener, address) = bind(&args.listen)?;
    let tls = identity(&args, address)?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let options = gateway::Options {
        db: args.db,
        seed: args.seed,
        faults,
        slow_for: args.slow_for,
        lookup_delay: args.lookup_delay,
        key_window: args.key_window,
        limit: args.limit,
        token: args.token,
        return_after: args.return_after,
        tls,
    };
    // the ledger is opened before the URL is printed: a caller that read
    // the URL can pay at once
    gateway::open(&options.db).map_err(|e| Failure(format!("the ledger {}: {e}", options.db.display())))?;
    announce(scheme, address)?;
    gateway::serve(listener, options).map_err(|e| Failure(e.to_string()))
}
