//! Accounts and transfers: the checks and the balance moves.
//!
//! Runs inside the execution transaction, so the balances it reads cannot
//! change before it writes. Refusals here (unknown account, insufficient
//! funds) are decisions about the request, so they are stored and replayed
//! like a success.

use crate::clock::Timestamp;
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
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::UnknownAccount => "unknown_account",
            Refusal::InsufficientFunds => "insufficient_funds",
            Refusal::SameAccount => "invalid_request: src and dst must be different accounts",
            Refusal::BalanceOverflow => "balance_overflow",
        }
    }
}

/// Moves `t.amount` from `t.src` to `t.dst`; returns the new `transfer_id`.
pub fn transfer<T: Tx>(tx: &mut T, t: &Transfer, now: Timestamp) -> Result<Result<i64, Refusal>, StoreError> {
    let (Some(src), Some(dst)) = (tx.account(&t.src)?, tx.account(&t.dst)?) else {
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
    tx.set_balance(&src.id, src_after)?;
    tx.set_balance(&dst.id, dst_after)?;
    Ok(Ok(id))
}
