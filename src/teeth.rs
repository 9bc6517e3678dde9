//! Deliberately broken engines, to prove the test suite has teeth.
//!
//! Each [`Broken`] variant is a classic mistake of this lab. They exist only
//! in builds with `--features teeth` (`tests/teeth.rs` switches them on one at
//! a time and demands that scenarios or storms fail); in every other build
//! [`is`] is a constant `false` and the compiler removes the broken paths.

/// The mistakes, as the lab names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broken {
    /// Look the key up, then insert it later: racers both pass.
    LookupThenInsert,
    /// Write the key as completed before the money moves.
    CompletedBeforeExecute,
    /// Fingerprint the raw request text, not its canonical form.
    RawFingerprint,
    /// Rebuild the replayed body instead of returning the stored bytes.
    RecomputedReplay,
    /// Key by `idem_key` alone, not `(client_id, endpoint, idem_key)`.
    GlobalScope,
    /// Purge every key, whatever the cut.
    PurgeIgnoresCut,
}

impl Broken {
    pub const ALL: [Broken; 6] = [
        Broken::LookupThenInsert,
        Broken::CompletedBeforeExecute,
        Broken::RawFingerprint,
        Broken::RecomputedReplay,
        Broken::GlobalScope,
        Broken::PurgeIgnoresCut,
    ];
}

#[cfg(feature = "teeth")]
static CURRENT: std::sync::Mutex<Option<Broken>> = std::sync::Mutex::new(None);

/// Switches the process-wide broken variant (test builds only).
#[cfg(feature = "teeth")]
pub fn set(variant: Option<Broken>) {
    *CURRENT.lock().unwrap_or_else(|e| e.into_inner()) = variant;
}

/// Whether `variant` is switched on; always `false` without the feature.
#[inline(always)]
pub fn is(variant: Broken) -> bool {
    #[cfg(feature = "teeth")]
    {
        *CURRENT.lock().unwrap_or_else(|e| e.into_inner()) == Some(variant)
    }
    #[cfg(not(feature = "teeth"))]
    {
        let _ = variant;
        false
    }
}
