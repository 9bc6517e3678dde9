//! Calling out, and the stand-ins' HTTPS: one agent for every call idem
//! makes to another system (the payout gateway, client events, `idem
//! transfer`, the stand-in gateway's own events), and the server side of
//! TLS for `idem gateway --tls`.
//!
//! Every provider and client endpoint a payment service talks to is
//! `https://`. The agent verifies the peer against Mozilla's roots (bundled:
//! no system store needed) or, when the operator names a file, against the
//! certificates in it alone, as curl's `--cacert` does. It follows no
//! redirect: a 3xx is an answer, never a delivery or a payment made
//! elsewhere (Standard Webhooks and Svix count every 3xx as a failure, and
//! a `Location` is where a receiver could point idem at an inside address).
//!
//! A handshake that fails is counted and told to whoever listens
//! ([`on_tls_failure`]): a certificate the agent does not trust is the
//! operator's to see, never a silent hold.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;
use tokio_rustls::rustls;
use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig};

/// The roots the operator named ([`trust`]); Mozilla's when none.
static ROOTS: RwLock<Option<Arc<Vec<Certificate<'static>>>>> = RwLock::new(None);
static TLS_FAILURES: AtomicU64 = AtomicU64::new(0);
type Listener = Box<dyn Fn(&str, &str) + Send + Sync>;
static ON_TLS_FAILURE: OnceLock<Listener> = OnceLock::new();

/// Trusts the PEM certificates in `path` instead of Mozilla's roots, for
/// every call this process makes from now on. Returns how many it read; a
/// file without one is an error, not an empty trust.
pub fn trust(path: &Path) -> Result<usize, String> {
    let pem = std::fs::read(path).map_err(|e| format!("the CA file {}: {e}", path.display()))?;
    trust_pem(&pem).map_err(|e| format!("the CA file {}: {e}", path.display()))
}

/// [`trust`] of PEM text; certificates trusted before stay trusted (a
/// harness that starts several providers of its own trusts each).
pub fn trust_pem(pem: &[u8]) -> Result<usize, String> {
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(pem) {
        match item {
            Ok(PemItem::Certificate(cert)) => certs.push(cert.to_owned()),
            Ok(_) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    if certs.is_empty() {
        return Err("holds no PEM certificate".into());
    }
    let n = certs.len();
    let mut roots = ROOTS.write().unwrap_or_else(|e| e.into_inner());
    let mut all = roots.as_deref().cloned().unwrap_or_default();
    all.extend(certs);
    *roots = Some(Arc::new(all));
    Ok(n)
}

/// The agent for one kind of call: answers of any status are answers,
/// `timeout` bounds the whole exchange, no redirect is followed, and the
/// peer is verified against the roots of [`trust`] (Mozilla's by default).
pub fn agent(timeout: Duration) -> ureq::Agent {
    config(timeout).into()
}

/// [`agent`] for calls to addresses a client gave (its events endpoint):
/// with `Reach::Public`, a name that resolves only to addresses of the
/// inside (loopback, private, link-local, …: [`inside`]) is refused before
/// any connection, each address checked as the connection is made, so a
/// name that changes its answer between two calls (DNS rebinding) cannot
/// reach them either.
pub fn agent_reaching(timeout: Duration, reach: Reach) -> ureq::Agent {
    match reach {
        Reach::Any => agent(timeout),
        Reach::Public => ureq::Agent::with_parts(
            config(timeout),
            ureq::unversioned::transport::DefaultConnector::default(),
            PublicOnly(ureq::unversioned::resolver::DefaultResolver::default()),
        ),
    }
}

fn config(timeout: Duration) -> ureq::config::Config {
    let roots = match &*ROOTS.read().unwrap_or_else(|e| e.into_inner()) {
        Some(certs) => RootCerts::Specific(certs.clone()),
        None => RootCerts::WebPki,
    };
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .max_redirects(0)
        .tls_config(TlsConfig::builder().root_certs(roots).build())
        .build()
}

/// Which addresses a call may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Only public addresses: the default for endpoints clients give.
    Public,
    /// Any address (an operator's choice, and the tests' on loopback).
    Any,
}

/// Whether `ip` is an address of the inside: unspecified, loopback,
/// private (RFC 1918, IPv6 unique local), shared (RFC 6598), link-local
/// (cloud metadata services live there), multicast, broadcast, reserved;
/// an IPv4 address mapped into IPv6 as the IPv4 address itself.
pub fn inside(ip: std::net::IpAddr) -> bool {
    use std::net::IpAddr;
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_unspecified()
                || v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_broadcast()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || a >= 240
        }
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => inside(IpAddr::V4(v4)),
            None => {
                let first = v6.segments()[0];
                v6.is_unspecified()
                    || v6.is_loopback()
                    || v6.is_multicast()
                    || (first & 0xfe00) == 0xfc00
                    || (first & 0xffc0) == 0xfe80
            }
        },
    }
}

/// A resolver that keeps only public addresses ([`inside`]).
#[derive(Debug)]
struct PublicOnly(ureq::unversioned::resolver::DefaultResolver);

impl ureq::unversioned::resolver::Resolver for PublicOnly {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
        let all = self.0.resolve(uri, config, timeout)?;
        let mut public = self.empty();
        for address in all.iter().filter(|a| !inside(a.ip())) {
            public.push(*address);
        }
        if public.is_empty() {
            let host = uri.host().unwrap_or("");
            return Err(ureq::Error::Other(
                format!("{host} resolves only to inside addresses (loopback, private, link-local): refused")
                    .into(),
            ));
        }
        Ok(public)
    }
}

/// Whether `e` is a TLS failure: a handshake refused (a certificate not
/// trusted, a name that does not match, no protocol in common).
pub fn is_tls(e: &ureq::Error) -> bool {
    match e {
        ureq::Error::Rustls(_) | ureq::Error::Tls(_) | ureq::Error::TlsRequired => true,
        ureq::Error::Io(io) => io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()),
        _ => false,
    }
}

/// `e` as one line; a TLS failure is counted, told to the listener with
/// `url`'s host, and said as such (`TLS: …`).
pub fn why(url: &str, e: &ureq::Error) -> String {
    if !is_tls(e) {
        return e.to_string();
    }
    TLS_FAILURES.fetch_add(1, Ordering::Relaxed);
    let line = format!("TLS: {e}");
    if let Some(listener) = ON_TLS_FAILURE.get() {
        listener(host(url), &line);
    }
    line
}

/// TLS failures of this process's calls so far.
pub fn tls_failures() -> u64 {
    TLS_FAILURES.load(Ordering::Relaxed)
}

/// Tells `listener` (once per process: the service's log) the host and
/// the reason of every TLS failure.
pub fn on_tls_failure(listener: impl Fn(&str, &str) + Send + Sync + 'static) {
    let _ = ON_TLS_FAILURE.set(Box::new(listener));
}

/// `url`'s host and port, without the path (no token or query in a log).
fn host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    authority.rsplit_once('@').map_or(authority, |(_, host)| host)
}

/// What a server needs to speak TLS: its certificate chain and key.
#[derive(Clone)]
pub struct Identity {
    config: Arc<rustls::ServerConfig>,
    /// The certificate, PEM, for a client to trust ([`trust`]) when it is
    /// one of our own making.
    pub cert_pem: String,
}

impl Identity {
    /// A certificate of its own for `names` (DNS names or IP addresses),
    /// self-signed: a client trusts it by its PEM ([`Identity::cert_pem`]).
    pub fn self_signed(names: &[String]) -> Result<Identity, String> {
        let made = rcgen::generate_simple_self_signed(names.to_vec()).map_err(|e| e.to_string())?;
        let key = made.signing_key.serialize_pem();
        Identity::of_pem(made.cert.pem().as_bytes(), key.as_bytes())
    }

    /// The certificate chain and the private key of two PEM files.
    pub fn of_files(cert: &Path, key: &Path) -> Result<Identity, String> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        Identity::of_pem(&read(cert)?, &read(key)?)
    }

    fn of_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Identity, String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let chain = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("the certificate: {e}"))?;
        if chain.is_empty() {
            return Err("the certificate file holds no PEM certificate".into());
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("the key: {e}"))?;
        // ring, as ureq's rustls: one crypto library in the build. Its
        // lack of post-quantum key exchange is rustls' reason to deprecate
        // it; this server is the stand-in provider of tests and chaos days.
        #[allow(deprecated)]
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| format!("the certificate and key: {e}"))?;
        let cert_pem = String::from_utf8_lossy(cert_pem).into_owned();
        Ok(Identity { config: Arc::new(config), cert_pem })
    }

    /// Its rustls configuration, for a server of its own making (a test's).
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        self.config.clone()
    }

    /// The acceptor that makes a TCP connection a TLS one.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config.clone())
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the key
        f.write_str("Identity")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_named_without_credentials_path_or_query() {
        assert_eq!(host("https://user:pw@pay.example:8443/v1/payouts?x=1"), "pay.example:8443");
        assert_eq!(host("http://127.0.0.1:9/"), "127.0.0.1:9");
        assert_eq!(host("pay.example"), "pay.example");
    }

    #[test]
    fn inside_addresses_are_told_from_public_ones() {
        let inside_ones = [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
        ];
        for ip in inside_ones {
            assert!(inside(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["93.184.216.34", "8.8.8.8", "172.32.0.1", "100.128.0.1", "2606:4700::1111"] {
            assert!(!inside(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "not a certificate").unwrap();
        assert!(trust(&path).unwrap_err().contains("holds no PEM certificate"));
        assert!(trust(&dir.path().join("absent.pem")).unwrap_err().contains("absent.pem"));
    }
}
