//! `chaos_report.md`: the day's summary for a person.

use super::verdict::{Failover, Summary};

/// The report: the headline verdict, what the network and the machine room
/// did, the payouts, the failovers, and the outcomes nobody knew.
pub(super) fn report(s: &Summary) -> String {
    let verdict = if s.exactly_once() { "**Exactly once.**" } else { "**NOT exactly once.**" };
    let mut md = format!(
        "# idem chaos: seed {}\n\n{verdict} {} clients intended {} transfers; {} went out. \
         Paid twice: {}. Lost (a client was told, the database has none): {}. Made with no intent behind them: {}. \
         Answers naming another transfer: {}. Balances conserved: {}.\n\n",
        s.seed,
        s.clients,
        s.transfers_intended,
        s.transfers_made,
        s.transfers_paid_twice,
        s.transfers_lost,
        s.transfers_unintended,
        s.answers_misattributed,
        s.balances_conserved
    );
    md.push_str("| what the network and the machine room did | count |\n|---|---:|\n");
    for (what, n) in [
        ("requests sent through the proxy", s.requests_sent),
        ("requests dropped before the server", s.requests_dropped),
        ("answers dropped after the server committed", s.responses_dropped),
        ("answers cut in half", s.responses_cut),
        ("requests delayed", s.requests_delayed),
        ("requests delivered twice at once", s.requests_duplicated),
        ("requests that found the server down", s.requests_unreachable),
        ("instances of the server", s.instances as u64),
        ("server kills (SIGKILL) and restarts", s.server_kills as u64),
        ("faults of the replicated database", s.failovers.len() as u64),
        ("database restarts", s.database_restarts as u64),
        ("claims of the killed released (idem recover --release)", s.claims_released_after_kills as u64),
    ] {
        md.push_str(&format!("| {what} | {n} |\n"));
    }
    md.push_str(&format!(
        "\nAttempts per transfer: {} on average, {} at most. Time to certainty: p50 {} ms, p99 {} ms. \
         Outcomes unknown when the budget ran out: {}.\n",
        s.attempts_per_transfer_mean,
        s.attempts_per_transfer_max,
        s.time_to_certainty_ms_p50,
        s.time_to_certainty_ms_p99,
        s.outcomes_unknown
    ));
    md.push_str(&format!(
        "Keys still claimed at the end of the day (each blocking its retries until its lease ends): {}.\n",
        s.keys_left_claimed
    ));
    md.push_str(&payouts(s));
    md.push_str(&failovers(s));
    md.push_str(
        "\n![The day: transfers made, replays and failures per second; faults dashed](chaos_timeline.svg)\n",
    );
    md
}

/// The payouts' paragraph, on a day with payouts.
fn payouts(s: &Summary) -> String {
    let mut md = String::new();
    if let Some(p) = &s.payouts {
        md.push_str(&format!(
            "\n**Payouts** ({}): {} intended, {} completed, {} failed (the gateway refused: the hold released), \
             {} returned after they were paid (credited back; {} returned at the gateway). Sends per payout: \
             median {}, most {}. Made twice: {}. Paid twice at the gateway: {}. Paid at the gateway with no idem intent: {}. \
             A client told paid, the gateway did not pay: {}. idem and the gateway disagree: {}. \
             Rows in the gateway's ledger: {}. Settled by a reconciliation, not by their request: {}.\n",
            if p.exactly_once() { "exactly once" } else { "NOT exactly once" },
            p.intended,
            p.completed,
            p.failed,
            p.returned,
            p.returned_at_gateway,
            p.sends_median,
            p.sends_max,
            p.made_twice,
            p.paid_twice_at_gateway,
            p.at_gateway_without_intent,
            p.told_but_not_paid,
            p.disagreements,
            p.gateway_ledger_rows,
            p.settled_by_reconciliation
        ));
        let t = &p.told;
        md.push_str(&format!(
            "\n**Clients told** ({}): {} changes no answer told (by a reconciler or a provider's event), \
             {} received by the clients' receiver (down for the first 3 s, then 20 % of answers lost, \
             10 % 503, 10 % slow), in {} deliveries; attempts per event: median {}, most {}. \
             Told under two ids, or two changes under one: {}. Signatures that did not verify: {}. \
             Left failed for a person: {}.\n",
            if t.whole() { "every change, once per id" } else { "NOT every change once" },
            t.changes,
            t.received,
            t.deliveries,
            t.attempts_median,
            t.attempts_max,
            t.told_twice,
            t.unsigned,
            t.left_failed
        ));
        for why in &p.left_for_a_person {
            md.push_str(&format!("- left for a person: {why}\n"));
        }
    }
    md
}

/// Per kind of fault: the write-unavailability windows (the longest
/// stretch without a transfer made, from the fault to the next) as a distribution (p50, p95, max, and how many
/// never resumed before the next fault), and what became of the intents
/// that ended after each.
fn by_kind(s: &Summary) -> String {
    let mut md = String::from(
        "\n| fault | runs | writes unavailable p50 / p95 / max | not resumed before the next | \
         acknowledged | unknown | lost | paid twice |\n|---|---:|---|---:|---:|---:|---:|---:|\n",
    );
    let mut kinds: Vec<&str> = s.failovers.iter().map(|f| f.kind.as_str()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    for kind in kinds {
        let runs: Vec<&Failover> = s.failovers.iter().filter(|f| f.kind == kind).collect();
        let mut ms: Vec<u64> = runs.iter().filter_map(|f| f.writes_unavailable_ms).collect();
        ms.sort_unstable();
        let at = |q: f64| ms.get(((ms.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied();
        let show = |v: Option<u64>| v.map_or("-".into(), |v| format!("{:.1} s", v as f64 / 1000.0));
        let sum = |f: fn(&Failover) -> usize| runs.iter().map(|r| f(r)).sum::<usize>();
        md.push_str(&format!(
            "| {kind} | {} | {} / {} / {} | {} | {} | {} | {} | {} |\n",
            runs.len(),
            show(at(0.5)),
            show(at(0.95)),
            show(ms.last().copied()),
            runs.len() - ms.len(),
            sum(|f| f.acknowledged),
            sum(|f| f.unknown),
            sum(|f| f.lost),
            sum(|f| f.paid_twice),
        ));
    }
    md
}

/// The failovers' table and the outcomes nobody knew.
fn failovers(s: &Summary) -> String {
    let mut md = String::new();
    if s.failovers_not_run > 0 {
        md.push_str(&format!(
            "Faults of the database not run because every client had finished first: {} (more --transfers make a longer day).\n",
            s.failovers_not_run
        ));
    }
    if !s.failovers.is_empty() {
        md.push_str(&by_kind(s));
        md.push_str(
            "\n| fault | at | writes unavailable | answered 503 meanwhile | 409 | unanswered | \
             commits whose answer was lost, found by the retry |\n|---|---:|---:|---:|---:|---:|---:|\n",
        );
        for f in &s.failovers {
            let stopped =
                f.writes_unavailable_ms.map_or("not resumed before the next".into(), |ms| format!("{ms} ms"));
            md.push_str(&format!(
                "| {} | {} ms | {stopped} | {} | {} | {} | {} |\n",
                f.kind, f.at_ms, f.answered_503, f.answered_409, f.unanswered, f.acks_lost_found_by_retry
            ));
        }
    }
    if !s.unknown.is_empty() {
        md.push_str("\n| client | key | what the database says |\n|---:|---|---|\n");
        for u in &s.unknown {
            md.push_str(&format!("| {} | `{}` | {} |\n", u.client, u.key, u.database));
        }
    }
    md
}
