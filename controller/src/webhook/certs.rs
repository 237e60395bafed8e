//! The webhook's serving certificate: made here (a CA of its own that signs it), or read from the
//! PEM files of a Secret (cert-manager's), and swapped under a running server without a restart.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::crypto::ring::sign::any_supported_type;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CertError {
    #[error("making the webhook's {what}: {source}")]
    Generate {
        what: &'static str,
        #[source]
        source: rcgen::Error,
    },
    #[error("{what}: {message}")]
    Pem { what: String, message: String },
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
}

fn gen_err(what: &'static str) -> impl FnOnce(rcgen::Error) -> CertError {
    move |source| CertError::Generate { what, source }
}

/// A certificate made by [`self_signed`]: the CA the API server must trust (the caBundle) and the
/// serving certificate and key it signed, PEM-encoded.
#[derive(Clone)]
pub struct SelfSigned {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for SelfSigned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("SelfSigned")
            .field("ca_pem", &self.ca_pem)
            .finish_non_exhaustive()
    }
}

/// A fresh CA and a serving certificate it signs for `hosts` (DNS names or IP addresses), both
/// valid from an hour ago (clock skew between this pod and the API server) for `validity`.
pub fn self_signed(hosts: &[String], validity: Duration) -> Result<SelfSigned, CertError> {
    let now = time::OffsetDateTime::now_utc();
    let not_before = now - time::Duration::hours(1);
    let not_after = now + time::Duration::try_from(validity).unwrap_or(time::Duration::days(365));

    let ca_key = KeyPair::generate().map_err(gen_err("CA key"))?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "gpupool-webhook-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_before = not_before;
    ca.not_after = not_after;
    let ca_cert = ca.self_signed(&ca_key).map_err(gen_err("CA certificate"))?;

    let key = KeyPair::generate().map_err(gen_err("serving key"))?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(
        DnType::CommonName,
        hosts.first().map_or("gpupool-webhook", String::as_str),
    );
    for host in hosts {
        params.subject_alt_names.push(match host.parse() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(
                host.clone()
                    .try_into()
                    .map_err(gen_err("serving certificate's names"))?,
            ),
        });
    }
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.not_before = not_before;
    params.not_after = not_after;
    let cert = params
        .signed_by(&key, &Issuer::from_params(&ca, &ca_key))
        .map_err(gen_err("serving certificate"))?;
    Ok(SelfSigned {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A certificate chain and key in PEM, ready to serve; `what` names where they came from.
pub fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    what: &str,
) -> Result<CertifiedKey, CertError> {
    let pem_err = |message: String| CertError::Pem {
        what: what.to_string(),
        message,
    };
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(format!("certificate: {e}")))?;
    if chain.is_empty() {
        return Err(pem_err("no certificate in the PEM".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| pem_err(format!("key: {e}")))?;
    let signing_key = any_supported_type(&key).map_err(|e| pem_err(format!("key: {e}")))?;
    Ok(CertifiedKey::new(chain, signing_key))
}

/// The certificate the server presents, replaceable while it runs (rotation, a renewed Secret).
#[derive(Debug)]
pub struct CurrentCert(RwLock<Arc<CertifiedKey>>);

impl CurrentCert {
    pub fn new(key: CertifiedKey) -> Arc<CurrentCert> {
        Arc::new(CurrentCert(RwLock::new(Arc::new(key))))
    }

    pub fn replace(&self, key: CertifiedKey) {
        *self
            .0
            .write()
            .expect("the certificate lock is never poisoned") = Arc::new(key);
    }
}

impl ResolvesServerCert for CurrentCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.0
                .read()
                .expect("the certificate lock is never poisoned")
                .clone(),
        )
    }
}

/// A TLS server configuration presenting `cert`, on ring (kube's provider), HTTP/2 and HTTP/1.1.
pub fn server_config(cert: Arc<CurrentCert>) -> Result<Arc<rustls::ServerConfig>, CertError> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_cert_resolver(cert);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_self_signed_pair_loads_and_the_key_is_never_printed() {
        let made = self_signed(
            &["gpupool-webhook.gpupool.svc".into(), "127.0.0.1".into()],
            Duration::from_secs(3600),
        )
        .unwrap();
        assert!(made.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert_ne!(made.ca_pem, made.cert_pem);
        let key = certified_key(made.cert_pem.as_bytes(), made.key_pem.as_bytes(), "made").unwrap();
        assert_eq!(key.cert.len(), 1);
        assert!(!format!("{made:?}").contains("PRIVATE KEY"));
        let current = CurrentCert::new(key);
        assert!(server_config(current).is_ok());
    }

    #[test]
    fn bad_pem_names_what_is_wrong() {
        let e = certified_key(b"nothing", b"nothing", "tls.crt").unwrap_err();
        assert!(e.to_string().starts_with("tls.crt: no certificate"), "{e}");
        let made = self_signed(&["x".into()], Duration::from_secs(60)).unwrap();
        let e = certified_key(made.cert_pem.as_bytes(), b"", "tls.key").unwrap_err();
        assert!(e.to_string().starts_with("tls.key: key"), "{e}");
    }
}
