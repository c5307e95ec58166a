//! TLS on the NBD port (the NBD protocol's STARTTLS option), for exports that must not
//! be open to whoever reaches the port.
//!
//! With `tls = "require"` among a node's `[front_end.options]` a client must ask for TLS
//! before anything else; the server presents the node's NBD certificate (`tls_cert`,
//! `tls_key`, signed by the cluster CA, naming the addresses clients dial) and accepts
//! only clients whose certificate the cluster CA signed. `keel init --service block
//! --nbd-tls` writes both and a client directory (`ca-cert.pem`, `client-cert.pem`,
//! `client-key.pem`) that libnbd's `tls-certificates=` and qemu's `tls-creds-x509` read.

use keel::runtime::config::{write_secret, NodeFile};
use keel::runtime::provision::node_dirs;
use keel::runtime::tls::{issue_named, server_config, Credentials};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokio_rustls::TlsAcceptor;

/// The front end's options (`[front_end.options]` in node.toml).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrontOptions {
    /// TLS required on the NBD port, with the server's certificate and key.
    pub tls: Option<TlsFiles>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl FrontOptions {
    /// From `[front_end.options]`: `tls = "off"` (the default) or `"require"`, and then
    /// `tls_cert` and `tls_key` (paths relative to `dir`, the node file's directory).
    /// Anything else is an error, so a typo does not leave a port open.
    ///
    /// # Errors
    /// A message naming the option.
    pub fn from_settings(options: &BTreeMap<String, String>, dir: &Path) -> Result<FrontOptions, String> {
        let (mut require, mut cert, mut key) = (false, None, None);
        for (name, value) in options {
            match (name.as_str(), value.as_str()) {
                ("tls", "require") => require = true,
                ("tls", "off") => require = false,
                ("tls", other) => return Err(format!("block front end: tls = {other:?}: off or require")),
                ("tls_cert", path) => cert = Some(dir.join(path)),
                ("tls_key", path) => key = Some(dir.join(path)),
                (other, _) => {
                    return Err(format!("block front end: unknown option {other:?} (known: tls, tls_cert, tls_key)"))
                }
            }
        }
        if !require {
            return Ok(FrontOptions { tls: None });
        }
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(FrontOptions { tls: Some(TlsFiles { cert, key }) }),
            _ => Err("block front end: tls = \"require\" needs tls_cert and tls_key".into()),
        }
    }
}

/// The NBD port's TLS server: the files' certificate, clients checked against `ca_pem`.
///
/// # Errors
/// A file cannot be read, or the certificate or key is not usable.
pub fn acceptor(ca_pem: &str, files: &TlsFiles) -> Result<TlsAcceptor, String> {
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("NBD TLS: {}: {e}", p.display()));
    let own = Credentials { cert_pem: read(&files.cert)?, key_pem: read(&files.key)? };
    let config = server_config(ca_pem, &own).map_err(|e| format!("NBD TLS: {e}"))?;
    Ok(TlsAcceptor::from(config))
}

/// The directory `keel init --nbd-tls` writes for NBD clients, in the cluster directory.
pub const CLIENT_DIR: &str = "nbd-client";

/// `keel init --service block --nbd-tls`, after the cluster directory `dir` is written:
/// each node with a front end gets a certificate for its NBD port (naming the address
/// it listens on, and localhost) and requires TLS; clients get [`CLIENT_DIR`], the
/// layout libnbd (`tls-certificates=`) and qemu (`tls-creds-x509`) read, with a
/// certificate that names no Keel identity, so it opens the NBD ports and nothing else.
///
/// # Errors
/// A file cannot be read or written, or a certificate cannot be issued.
pub fn provision(dir: &Path) -> Result<PathBuf, String> {
    let read = |p: PathBuf| std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()));
    let ca = Credentials { cert_pem: read(dir.join("ca.pem"))?, key_pem: read(dir.join("ca.key"))? };
    for (id, node_dir) in node_dirs(dir) {
        let path = node_dir.join("node.toml");
        let file = NodeFile::read(&path).map_err(|e| e.to_string())?;
        let Some(listen) = file.front_end.map(|fe| fe.listen) else { continue };
        let own = issue_named(&ca, &format!("nbd-node-{id}"), &[listen.ip().to_string(), "localhost".into()])
            .map_err(|e| e.to_string())?;
        let tls_dir = node_dir.join("nbd-tls");
        std::fs::create_dir_all(&tls_dir).map_err(|e| format!("{}: {e}", tls_dir.display()))?;
        write_secret(&tls_dir.join("server-cert.pem"), &own.cert_pem).map_err(|e| e.to_string())?;
        write_secret(&tls_dir.join("server-key.pem"), &own.key_pem).map_err(|e| e.to_string())?;
        NodeFile::edit(&path, |f| {
            if let Some(fe) = f.front_end.as_mut() {
                fe.options.insert("tls".into(), "require".into());
                fe.options.insert("tls_cert".into(), "nbd-tls/server-cert.pem".into());
                fe.options.insert("tls_key".into(), "nbd-tls/server-key.pem".into());
            }
        })
        .map_err(|e| e.to_string())?;
    }
    let client_dir = dir.join(CLIENT_DIR);
    std::fs::create_dir_all(&client_dir).map_err(|e| format!("{}: {e}", client_dir.display()))?;
    let client = issue_named(&ca, "nbd-client", &[]).map_err(|e| e.to_string())?;
    write_secret(&client_dir.join("ca-cert.pem"), &ca.cert_pem).map_err(|e| e.to_string())?;
    write_secret(&client_dir.join("client-cert.pem"), &client.cert_pem).map_err(|e| e.to_string())?;
    write_secret(&client_dir.join("client-key.pem"), &client.key_pem).map_err(|e| e.to_string())?;
    Ok(client_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_refuse_what_they_do_not_know() {
        let dir = Path::new("/n");
        let map = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(FrontOptions::from_settings(&map(&[]), dir), Ok(FrontOptions::default()));
        let on =
            FrontOptions::from_settings(&map(&[("tls", "require"), ("tls_cert", "c.pem"), ("tls_key", "k.pem")]), dir);
        assert_eq!(on, Ok(FrontOptions { tls: Some(TlsFiles { cert: "/n/c.pem".into(), key: "/n/k.pem".into() }) }));
        let off = FrontOptions::from_settings(&map(&[("tls", "off"), ("tls_cert", "c.pem")]), dir);
        assert_eq!(off, Ok(FrontOptions::default()));
        for bad in [&[("tls", "yes")][..], &[("tls", "require")], &[("tsl", "require")]] {
            assert!(FrontOptions::from_settings(&map(bad), dir).is_err(), "{bad:?}");
        }
    }
}
