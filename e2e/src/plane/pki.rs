//! The control plane's certificates and keys, made fresh for each plane: one CA that signs the API
//! server's serving certificate and the client certificates (the `--client-ca-file`), a second one
//! for the request-header (front proxy) CA that kube-apiserver refuses to share with the first, and
//! the ServiceAccount token signing key.
//!
//! ECDSA P-256 throughout: kube-apiserver signs ServiceAccount tokens with it (ES256).

use std::net::{IpAddr, Ipv4Addr};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

#[derive(Debug, thiserror::Error)]
#[error("making the control plane's {what}: {source}")]
pub struct PkiError {
    what: &'static str,
    #[source]
    source: rcgen::Error,
}

fn pki_err(what: &'static str) -> impl FnOnce(rcgen::Error) -> PkiError {
    move |source| PkiError { what, source }
}

/// A certificate and its private key, PEM-encoded.
#[derive(Clone, Debug)]
pub struct CertKey {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The names the API server's certificate is valid for: loopback as clients dial it, and the
/// in-cluster names of the `kubernetes` Service (first address of `--service-cluster-ip-range`).
pub const SERVING_NAMES: &[&str] = &[
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];
pub const SERVING_IPS: &[IpAddr] = &[
    IpAddr::V4(Ipv4Addr::LOCALHOST),
    IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1)),
];

pub struct Pki {
    ca_params: CertificateParams,
    ca_key: KeyPair,
    pub ca_pem: String,
    /// The front proxy's CA (`--requestheader-client-ca-file`): nothing is signed by it here, but the
    /// scheduler and the controller-manager read it to authenticate their own callers.
    pub front_proxy_ca_pem: String,
    pub serving: CertKey,
    /// PKCS#8 private key that signs ServiceAccount tokens (`--service-account-signing-key-file`,
    /// and the controller-manager's `--service-account-private-key-file`).
    pub service_account_key_pem: String,
    /// Its public half, which verifies them (`--service-account-key-file`).
    pub service_account_public_pem: String,
}

impl Pki {
    pub fn generate() -> Result<Pki, PkiError> {
        let (ca_params, ca_key, ca_pem) = certificate_authority("gpupool-e2e-ca")?;
        let (_, _, front_proxy_ca_pem) = certificate_authority("gpupool-e2e-front-proxy-ca")?;
        let service_account_key =
            KeyPair::generate().map_err(pki_err("ServiceAccount signing key"))?;
        let mut pki = Pki {
            ca_params,
            ca_key,
            ca_pem,
            front_proxy_ca_pem,
            serving: CertKey {
                cert_pem: String::new(),
                key_pem: String::new(),
            },
            service_account_key_pem: service_account_key.serialize_pem(),
            service_account_public_pem: service_account_key.public_key_pem(),
        };
        pki.serving = pki.serving_cert()?;
        Ok(pki)
    }

    fn issuer(&self) -> Issuer<'_, &KeyPair> {
        Issuer::from_params(&self.ca_params, &self.ca_key)
    }

    fn serving_cert(&self) -> Result<CertKey, PkiError> {
        let key = KeyPair::generate().map_err(pki_err("serving key"))?;
        let names: Vec<String> = SERVING_NAMES.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).map_err(pki_err("serving names"))?;
        params
            .subject_alt_names
            .extend(SERVING_IPS.iter().map(|ip| rcgen::SanType::IpAddress(*ip)));
        params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params
            .signed_by(&key, &self.issuer())
            .map_err(pki_err("serving certificate"))?;
        Ok(CertKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A client certificate for user `user` in `groups` (the subject's CN and O, which is how
    /// kube-apiserver reads an X.509 identity), e.g. `system:node:<name>` in `system:nodes`.
    pub fn client_cert(&self, user: &str, groups: &[&str]) -> Result<CertKey, PkiError> {
        let key = KeyPair::generate().map_err(pki_err("client key"))?;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, user);
        for group in groups {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *group);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params
            .signed_by(&key, &self.issuer())
            .map_err(pki_err("client certificate"))?;
        Ok(CertKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A self-signed CA named `name`: its parameters and key (to sign with) and its certificate.
fn certificate_authority(name: &str) -> Result<(CertificateParams, KeyPair, String), PkiError> {
    let key = KeyPair::generate().map_err(pki_err("CA key"))?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let pem = params
        .self_signed(&key)
        .map_err(pki_err("CA certificate"))?
        .pem();
    Ok((params, key, pem))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_is_pem_of_its_kind() {
        let pki = Pki::generate().unwrap();
        assert!(pki.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert_ne!(pki.ca_pem, pki.front_proxy_ca_pem);
        assert!(pki
            .serving
            .cert_pem
            .starts_with("-----BEGIN CERTIFICATE-----"));
        for key in [&pki.serving.key_pem, &pki.service_account_key_pem] {
            assert!(key.starts_with("-----BEGIN PRIVATE KEY-----"), "{key}");
        }
        assert!(pki
            .service_account_public_pem
            .starts_with("-----BEGIN PUBLIC KEY-----"));
        let client = pki
            .client_cert("system:node:n1", &["system:nodes"])
            .unwrap();
        assert_ne!(client.cert_pem, pki.serving.cert_pem);
        assert_ne!(client.key_pem, pki.serving.key_pem);
    }
}
