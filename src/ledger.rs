//! Accounts and transfers: the checks and the balance moves.
//!
//! Runs inside the execution transaction with both accounts locked, so the
//! balances it reads cannot change before it writes. Refusals here (unknown
//! account, insufficient funds) are decisions about the request, so they are
//! stored and replayed like a success.

use crate::clock::Timestamp;
use crate::reason::Reason;
use crate::request::Transfer;
use crate::store::{NewTransfer, StoreError, Tx};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    UnknownAccount,
    InsufficientFunds,
    /// `src` and `dst` spelled differently (`1` and `"1"`) but naming one row.
    SameAccount,
    /// The credit would overflow the destination's `i64` balance.
    BalanceOverflow,
}

impl Refusal {
    pub fn reason(self) -> Reason {
        match self {
            Refusal::UnknownAccount => Reason::UnknownAccount,
            Refusal::InsufficientFunds => Reason::InsufficientFunds,
            Refusal::SameAccount => {
                Reason::Invalid("invalid_request: src and dst must be different accounts".into())
            }
            Refusal::BalanceOverflow => Reason::BalanceOverflow,
        }
    }
}

/// Moves `t.amount` from `t.src` to `t.dst`; returns the new `transfer_id`.
pub fn transfer(tx: &mut dyn Tx, t: &Transfer, now: Timestamp) -> Result<Result<i64, Refusal>, StoreError> {
    // Both accounts are locked in one order whatever the direction, so A→B
    // racing B→A waits for the other instead of deadlocking.
    let src_first = t.src <= t.dst;
    let first = tx.lock_account(if src_first { &t.src } else { &t.dst })?;
    let second = tx.lock_account(if src_first { &t.dst } else { &t.src })?;
    let (src, dst) = if src_first { (first, second) } else { (second, first) };
    let (Some(src), Some(dst)) = (src, dst) else {
        return Ok(Err(Refusal::UnknownAccount));
    };
    if src.id == dst.id {
        return Ok(Err(Refusal::SameAccount));
    }
    let Some(src_after) = src.balance.checked_sub(t.amount).filter(|b| *b >= 0) else {
        return Ok(Err(Refusal::InsufficientFunds));
    };
    let Some(dst_after) = dst.balance.checked_add(t.amount) else {
        return Ok(Err(Refusal::BalanceOverflow));
    };
    let id = tx.insert_transfer(&NewTransfer {
        src: &src.id,
        dst: &dst.id,
        amount: t.amount,
        currency: &t.currency,
        created_at: now,
    })?;
    // The stored balances must be exactly the ones computed here. A column
    // that rounds (REAL beyond 2^53) would make them differ; then the whole
    // execution rolls back rather than lose a unit.
    for (account, delta, want) in [(&src, -t.amount, src_after), (&dst, t.amount, dst_after)] {
        let got = tx.add_to_balance(&account.id, delta)?;
        if got != want {
            return Err(StoreError::Schema(format!(
                "account {:?}: balance stored as {got}, not {want}; the balance column cannot hold it exactly",
                account.id.to_string()
            )));
        }
    }
    Ok(Ok(id))
}
