//! The request log: one JSON line per request, written by a thread of its
//! own so that no request ever waits for stderr. A pipe nobody drains, a
//! slow terminal or a stalled log shipper fills a bounded queue; lines that
//! find it full are dropped and counted (`idem_log_lines_dropped_total`),
//! and the service goes on answering.
//!
//! Keys are logged as a keyed hash: HMAC-SHA-256 under a secret of this
//! process (or `IDEM_LOG_SECRET`), of the client and the key. A plain hash
//! of a guessable key (`order-1`) is reversed by a dictionary and links one
//! key string across clients; the keyed hash is neither, yet one key's lines
//! still share one tag.

use sha2::{Digest, Sha256};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

/// Lines that may wait for the writer before new ones are dropped.
const QUEUE_LINES: usize = 8192;

pub struct Log {
    lines: SyncSender<String>,
    /// Lines accepted by the queue, and lines the writer has written: equal
    /// when nothing is waiting.
    queued: AtomicU64,
    written: std::sync::Arc<AtomicU64>,
    dropped: AtomicU64,
    secret: Vec<u8>,
}

impl Log {
    /// Starts the writer thread on `sink`. `secret` keys the key tags; a
    /// random one is drawn when none is given.
    pub fn start(sink: Box<dyn Write + Send>, secret: Option<Vec<u8>>) -> std::io::Result<Log> {
        let secret = match secret {
            Some(secret) if !secret.is_empty() => secret,
            _ => {
                let mut random = vec![0u8; 32];
                getrandom::fill(&mut random).map_err(|e| std::io::Error::other(e.to_string()))?;
                random
            }
        };
        let (lines, queue) = sync_channel(QUEUE_LINES);
        let written = std::sync::Arc::new(AtomicU64::new(0));
        let count = written.clone();
        std::thread::Builder::new()
            .name("idem-log".into())
            .spawn(move || write_lines(sink, &queue, &count))?;
        Ok(Log { lines, queued: AtomicU64::new(0), written, dropped: AtomicU64::new(0), secret })
    }

    /// Queues one line (without its newline); never waits.
    pub fn line(&self, line: String) {
        match self.lines.try_send(line) {
            Ok(()) => {
                self.queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Lines dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The tag a key is logged under: 16 hex digits of the keyed hash.
    pub fn key_tag(&self, client: &str, key: &str) -> String {
        let mac = hmac_sha256(&self.secret, &[client.as_bytes(), b"\0", key.as_bytes()]);
        crate::hex::lower(&mac[..8])
    }

    /// Waits up to `limit` for the queued lines to be written (at shutdown);
    /// a sink that does not take them is not waited for longer.
    pub fn flush(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.written.load(Ordering::Relaxed) < self.queued.load(Ordering::Relaxed)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// How long the writer sleeps between batches while lines keep coming. It
/// then polls rather than waiting on the queue, so that a busy service's
/// requests never wake it line by line (a wake-up per line cost more CPU
/// than the line itself); an idle one's first line wakes it at once.
const BATCH_EVERY: Duration = Duration::from_millis(10);

fn write_lines(sink: Box<dyn Write + Send>, queue: &Receiver<String>, written: &AtomicU64) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, sink);
    // idle: wait for a line
    while let Ok(first) = queue.recv() {
        let mut next = Some(first);
        // busy: write what came, then look again a little later
        loop {
            let mut batch = 0;
            while let Some(line) = next {
                let _ = out.write_all(line.as_bytes()).and_then(|()| out.write_all(b"\n"));
                batch += 1;
                next = queue.try_recv().ok();
            }
            let _ = out.flush();
            written.fetch_add(batch, Ordering::Relaxed);
            std::thread::sleep(BATCH_EVERY);
            match queue.try_recv() {
                Ok(line) => next = Some(line),
                Err(_) => break,
            }
        }
    }
    let _ = out.flush();
}

/// HMAC-SHA-256 (RFC 2104) of the concatenation of `parts`.
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let mut inner = Sha256::new();
    inner.update(pad(0x36));
    for part in parts {
        inner.update(part);
    }
    let mut outer = Sha256::new();
    outer.update(pad(0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::hex::lower as hex;

    #[test]
    fn hmac_matches_rfc_4231() {
        // test case 2: a key shorter than the block
        let mac = hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(hex(&mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        // test case 6: a key longer than the block is hashed first
        let mac = hmac_sha256(&[0xaa; 131], &[b"Test Using Larger Than Block-Size Key - Hash Key First"]);
        assert_eq!(hex(&mac), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }

    #[test]
    fn a_key_is_tagged_apart_per_client_and_per_secret() {
        let sink = || Box::new(std::io::sink()) as Box<dyn Write + Send>;
        let log = Log::start(sink(), Some(b"s".to_vec())).unwrap();
        assert_eq!(log.key_tag("shop-1", "order-1"), log.key_tag("shop-1", "order-1"));
        assert_ne!(log.key_tag("shop-1", "order-1"), log.key_tag("shop-2", "order-1"));
        let other = Log::start(sink(), Some(b"t".to_vec())).unwrap();
        assert_ne!(log.key_tag("shop-1", "order-1"), other.key_tag("shop-1", "order-1"));
        // not the plain SHA-256 prefix a dictionary reverses
        let plain = hex(&Sha256::digest(b"order-1")[..8]);
        assert_ne!(log.key_tag("shop-1", "order-1"), plain);
    }

    /// A sink that never takes a byte: the log drops, it never blocks.
    struct Stuck;
    impl Write for Stuck {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            std::thread::park();
            Ok(0)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stuck_sink_drops_lines_and_never_blocks_the_caller() {
        let log = Log::start(Box::new(Stuck), None).unwrap();
        let started = Instant::now();
        // lines of 100 bytes: the writer's 64 KiB buffer takes 655 of them
        // before the sink is first asked to write
        for i in 0..QUEUE_LINES + 1000 {
            log.line(format!("{i:0>100}"));
        }
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(log.dropped() >= 99, "{} dropped", log.dropped());
        log.flush(Duration::from_millis(50)); // returns though nothing is written
    }
}
