use super::fresh_token;

/// Claim tokens must never repeat within a process (a repeat would let
/// one attempt complete another's claim), whatever thread draws them.
#[test]
fn tokens_never_repeat_across_threads() {
    let drawn: Vec<String> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4)
            .map(|_| s.spawn(|| (0..25_000).map(|_| fresh_token().unwrap()).collect::<Vec<_>>()))
            .collect();
        threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
    });
    assert!(drawn.iter().all(|t| t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit())));
    let distinct: std::collections::HashSet<&String> = drawn.iter().collect();
    assert_eq!(distinct.len(), drawn.len());
}
