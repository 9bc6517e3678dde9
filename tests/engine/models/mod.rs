//! What the engine's suites judge with: the deliberately broken engines,
//! each the real protocol but for one classic mistake (`broken`); the loom
//! models of the claim race and of per-row locks (`loom_claim`,
//! `loom_rows`); the storm's random days and oracle (`storm`); and the
//! service's async conductor as an engine the storm can drive (`awaited`).

pub mod awaited;
pub mod broken;
pub mod loom_claim;
pub mod loom_rows;
pub mod storm;
