//! Accounts and transfers: whether a transfer may go out, and what that
//! decision rests on.
//!
//! Pure: it decides on the accounts as an execution saw them, and says for
//! each the range of balances over which it would decide the same (its
//! premises). A store that locks as it reads has them hold by construction;
//! one that reads first and locks later (PostgreSQL, to hold no lock across
//! the network) writes only if they still hold. Refusals here (unknown
//! account, insufficient funds) are decisions about the request, so they
//! are stored and replayed like a success.

use crate::reason::Reason;
use crate::store::{Account, Premise};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// Why the ledger refuses a transfer: an answer stored and replayed like a success.
pub enum Refusal {
    /// `src` or `dst` is not an account.
    UnknownAccount,
    /// `src` holds less than the amount.
    InsufficientFunds,
    /// `src` and `dst` spelled differently (`1` and `"1"`) but naming one row.
    SameAccount,
    /// The credit would overflow the destination's `i64` balance.
    BalanceOverflow,
}

impl Refusal {
    /// The reason the stored answer carries.
    pub fn reason(self) -> Reason {
        match self {
            Refusal::UnknownAccount => Reason::UnknownAccount,
            Refusal::InsufficientFunds => Reason::InsufficientFunds,
            Refusal::SameAccount => Reason::invalid("src and dst must be different accounts"),
            Refusal::BalanceOverflow => Reason::BalanceOverflow,
        }
    }
}

/// The ledger's decision on moving an amount from `src` to `dst`, and the
/// premises (for `[src, dst]`) under which it is the same decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The decision: the transfer may go out, or why not.
    pub outcome: Result<(), Refusal>,
    /// What the decision rests on, for `[src, dst]`: a store writes only while they hold.
    pub premises: [Premise; 2],
}

/// Decides whether `amount` (positive) may move from `src` to `dst` as
/// they stand (`None`: no such account).
pub fn decide(src: Option<&Account>, dst: Option<&Account>, amount: i64) -> Verdict {
    let verdict = |outcome, premises| Verdict { outcome, premises };
    let (Some(s), Some(d)) = (src, dst) else {
        let premise = |a: Option<&Account>| if a.is_some() { Premise::PRESENT } else { Premise::Absent };
        return verdict(Err(Refusal::UnknownAccount), [premise(src), premise(dst)]);
    };
    if s.id == d.id {
        return verdict(Err(Refusal::SameAccount), [Premise::PRESENT; 2]);
    }
    let covers = Premise::Between { lo: amount, hi: i64::MAX };
    if s.balance < amount {
        let short = Premise::Between { lo: i64::MIN, hi: amount - 1 };
        return verdict(Err(Refusal::InsufficientFunds), [short, Premise::PRESENT]);
    }
    let room = i64::MAX - amount;
    if d.balance > room {
        let full = Premise::Between { lo: room + 1, hi: i64::MAX };
        return verdict(Err(Refusal::BalanceOverflow), [covers, full]);
    }
    verdict(Ok(()), [covers, Premise::Between { lo: i64::MIN, hi: room }])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::AcctId;
    use proptest::prelude::*;

    fn account(id: i64, balance: i64) -> Account {
        Account { id: AcctId::Int(id), balance }
    }

    /// Balances that sit on the edges the ledger decides by, and anywhere.
    fn balance() -> impl Strategy<Value = i64> {
        prop_oneof![
            Just(0),
            Just(1),
            Just(i64::MAX),
            Just(i64::MAX - 1),
            -10i64..10,
            0..1_000i64,
            any::<i64>()
        ]
    }

    fn side() -> impl Strategy<Value = Option<i64>> {
        prop_oneof![1 => Just(None), 6 => balance().prop_map(Some)]
    }

    proptest! {
        /// For accounts that meet the premises the decision is the same as
        /// the one they were computed from: a store that checks them under
        /// lock writes what a store that locked first would have.
        #[test]
        fn the_decision_is_the_same_wherever_its_premises_hold(
            amount in prop_oneof![Just(1i64), Just(i64::MAX), 1..1_000i64, 1..i64::MAX],
            seen in (side(), side()),
            now in (side(), side()),
        ) {
            let accounts = |(s, d): (Option<i64>, Option<i64>)| (s.map(|b| account(1, b)), d.map(|b| account(2, b)));
            let (s, d) = accounts(seen);
            let verdict = decide(s.as_ref(), d.as_ref(), amount);
            let (s2, d2) = accounts(now);
            let later = decide(s2.as_ref(), d2.as_ref(), amount);
            let hold = verdict.premises[0].holds(s2.as_ref()) && verdict.premises[1].holds(d2.as_ref());
            if hold {
                prop_assert_eq!(later.outcome, verdict.outcome);
            }
            // and the accounts it was decided on meet them
            prop_assert!(verdict.premises[0].holds(s.as_ref()) && verdict.premises[1].holds(d.as_ref()));
        }
    }

    #[test]
    fn one_row_named_twice_is_refused_whatever_its_balance() {
        let a = account(1, 50);
        assert_eq!(decide(Some(&a), Some(&a), 10).outcome, Err(Refusal::SameAccount));
    }

    #[test]
    fn the_whole_balance_goes_out_and_one_unit_more_does_not() {
        let (s, d) = (account(1, 100), account(2, 0));
        assert_eq!(decide(Some(&s), Some(&d), 100).outcome, Ok(()));
        assert_eq!(decide(Some(&s), Some(&d), 101).outcome, Err(Refusal::InsufficientFunds));
        let full = account(2, i64::MAX - 99);
        assert_eq!(decide(Some(&s), Some(&full), 99).outcome, Ok(()));
        assert_eq!(decide(Some(&s), Some(&full), 100).outcome, Err(Refusal::BalanceOverflow));
    }
}
