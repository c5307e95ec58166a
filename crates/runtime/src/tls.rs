//! TLS 1.3 with mutual authentication against a per-cluster CA (`keel init` mints it).
//!
//! Every node and client holds a certificate whose common name says who it is
//! (`node-3`, `client-1000`) and whose DNS name is `<name>.keel`. Both sides of every
//! connection present a certificate; a peer whose certificate the cluster CA did not sign
//! never gets past the handshake, and its identity is read from the certificate, never
//! from anything it says afterwards.

use keel_core::message::{ClientId, NodeId};
use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("PEM: {0}")]
    Pem(String),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(String),
}

/// Who is at the other end of a connection, as its certificate says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerId {
    Node(NodeId),
    Client(ClientId),
}

impl PeerId {
    pub fn name(self) -> String {
        match self {
            PeerId::Node(n) => format!("node-{n}"),
            PeerId::Client(c) => format!("client-{c}"),
        }
    }

    pub fn parse(name: &str) -> Option<PeerId> {
        if let Some(n) = name.strip_prefix("node-") {
            return n.parse().ok().map(PeerId::Node);
        }
        name.strip_prefix("client-").and_then(|c| c.parse().ok()).map(PeerId::Client)
    }

    /// The DNS name in the certificate, used as the TLS server name.
    pub fn server_name(self) -> ServerName<'static> {
        // "<name>.keel" is always a valid DNS name.
        ServerName::try_from(format!("{}.keel", self.name()))
            .unwrap_or_else(|_| ServerName::try_from("keel").expect("literal"))
    }
}

/// A PEM certificate and its PEM private key.
#[derive(Clone, Debug)]
pub struct Credentials {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Mints a cluster CA.
pub fn generate_ca() -> Result<Credentials, TlsError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "keel cluster CA");
    params.distinguished_name = dn;
    let cert = params.self_signed(&key)?;
    Ok(Credentials { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// Issues a certificate for `who`, signed by the CA.
pub fn issue(ca: &Credentials, who: PeerId) -> Result<Credentials, TlsError> {
    issue_named(ca, &who.name(), &[format!("{}.keel", who.name())])
}

/// Issues a certificate for `common_name` with the DNS names and IP addresses `names`,
/// signed by the CA. Under a name that is no Keel identity (not `node-N`, `client-N`) the
/// cluster's transport refuses it: for a service's own TLS port, its server or clients.
pub fn issue_named(ca: &Credentials, common_name: &str, names: &[String]) -> Result<Credentials, TlsError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key)?;
    let key = KeyPair::generate()?;
    // rcgen takes a name that parses as an IP address as an IP address entry.
    let mut params = CertificateParams::new(names.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Credentials { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

fn certs(pem: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem(e.to_string()))
}

fn key(pem: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| TlsError::Pem(e.to_string()))
}

fn roots(ca_pem: &str) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certs(ca_pem)? {
        roots.add(c)?;
    }
    Ok(roots)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts connections from holders of a CA-signed certificate only.
pub fn server_config(ca_pem: &str, own: &Credentials) -> Result<Arc<ServerConfig>, TlsError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca_pem)?), provider())
        .build()
        .map_err(|e| TlsError::Verifier(e.to_string()))?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(&own.cert_pem)?, key(&own.key_pem)?)?;
    Ok(Arc::new(config))
}

/// Dials nodes, presenting our certificate and checking theirs against the CA.
pub fn client_config(ca_pem: &str, own: &Credentials) -> Result<Arc<ClientConfig>, TlsError> {
    let config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(ca_pem)?)
        .with_client_auth_cert(certs(&own.cert_pem)?, key(&own.key_pem)?)?;
    Ok(Arc::new(config))
}

/// The identity in a verified peer certificate (its common name).
pub fn peer_identity(cert: &CertificateDer<'_>) -> Option<PeerId> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let cn = parsed.subject().iter_common_name().next()?.as_str().ok()?.to_string();
    PeerId::parse(&cn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_round_trip_through_certificates() {
        let ca = generate_ca().expect("ca");
        for who in [PeerId::Node(NodeId(3)), PeerId::Client(ClientId(1000))] {
            let c = issue(&ca, who).expect("issue");
            let der = certs(&c.cert_pem).expect("pem").remove(0);
            assert_eq!(peer_identity(&der), Some(who));
            server_config(&ca.cert_pem, &c).expect("server config");
            client_config(&ca.cert_pem, &c).expect("client config");
        }
        let named = issue_named(&ca, "nbd-client", &[]).expect("issue");
        let der = certs(&named.cert_pem).expect("pem").remove(0);
        assert_eq!(peer_identity(&der), None, "no Keel identity: the transport refuses it");
        server_config(&ca.cert_pem, &issue_named(&ca, "nbd-node-0", &["127.0.0.1".into()]).expect("issue"))
            .expect("server config");
        assert_eq!(PeerId::parse("node-x"), None);
        assert_eq!(PeerId::parse("admin"), None);
    }
}
