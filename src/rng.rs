//! A small seeded random number generator: the same sequence on every
//! machine, for generated days, storms, fault plans and backoff jitter; and
//! the UUID form 16 bytes are spelled in.

/// SplitMix64: tiny, fast, and the same on every machine.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`: the same seed, the same numbers.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    /// Uniform in `0..n` (n > 0; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// SplitMix64's finaliser: a bijection of `u64` that scatters every bit.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `bytes` as a UUID (RFC 9562) of `version`: its version and variant bits
/// set, in the 8-4-4-4-12 hex form.
pub fn uuid(mut bytes: [u8; 16], version: u8) -> String {
    bytes[6] = (bytes[6] & 0x0f) | (version << 4);
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex = crate::hex::lower(&bytes);
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}
