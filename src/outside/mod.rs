//! Stand-ins for the world outside idem, run by the tests, the benches and
//! `idem chaos` where a real one would be: a payout gateway with seeded
//! faults ([`gateway`], `idem gateway`), a network that loses, cuts and
//! repeats ([`proxy`]), and a TCP hop that adds a round trip's delay
//! ([`hop`]). None of them is part of idem; each keeps its own books so a
//! verdict can be read from them rather than from idem's.

pub mod gateway;
pub mod hop;
pub mod proxy;
