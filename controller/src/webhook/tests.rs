//! The server as the API server meets it: HTTPS with the CA it made, the answers to good and bad
//! bodies, and a stop that closes kept-alive connections.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::*;

async fn started() -> (Running, watch::Sender<bool>) {
    let (stop, stopped) = watch::channel(false);
    let settings = Settings::new(
        "127.0.0.1:0".parse().unwrap(),
        CertSource::SelfSigned {
            hosts: vec!["127.0.0.1".into()],
            validity: Duration::from_secs(3600),
            webhook_configuration: None,
        },
    );
    (start(settings, None, stopped).await.unwrap(), stop)
}

fn connector(ca_pem: &str) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One HTTP/1.1 request over TLS, verified against the webhook's CA: (status, body).
async fn request(running: &Running, method: &str, path: &str, body: Vec<u8>) -> (u16, String) {
    let ca = running.ca_bundle.as_ref().unwrap().borrow().clone();
    let tcp = TcpStream::connect(running.addr).await.unwrap();
    let tls = connector(&ca)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .expect("the certificate verifies against the CA the webhook published");
    let (mut read, mut write) = tokio::io::split(tls);
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // The server may answer (413) before the whole body is written: write aside, read here.
    let writer = tokio::spawn(async move {
        let _ = write.write_all(head.as_bytes()).await;
        let _ = write.write_all(&body).await;
        write
    });
    let mut response = Vec::new();
    let _ = read.read_to_end(&mut response).await;
    drop(writer.await);
    let text = String::from_utf8_lossy(&response).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

fn review_of(parameters: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0f0e4d3c-1111-2222-3333-444455556666",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "name": "c", "namespace": "n", "operation": "CREATE",
            "object": {"metadata": {"name": "c"}, "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpupool.dev"}}],
                "config": [{"opaque": {"driver": "gpupool.dev", "parameters": parameters}}]
            }}}
        }
    }))
    .unwrap()
}

#[tokio::test]
async fn reviews_are_answered_over_tls_and_bad_bodies_get_4xx() {
    let (running, stop) = started().await;
    let (status, body) = request(
        &running,
        "POST",
        "/validate",
        review_of(
            json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig", "compute": "Mpss"}),
        ),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], false);
    assert!(
        answer["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("opaque.parameters.compute: unsupported value \"Mpss\""),
        "{answer}"
    );

    let (status, body) = request(&running, "POST", "/validate", b"{not json".to_vec()).await;
    assert_eq!(status, 400);
    assert!(body.contains("not JSON"), "{body}");
    let v1beta1 = br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"x"}}"#;
    let (status, body) = request(&running, "POST", "/validate", v1beta1.to_vec()).await;
    assert_eq!(status, 400);
    assert!(body.contains("admission.k8s.io/v1"), "{body}");
    let oversized = vec![b' '; review::MAX_BODY_BYTES + 1];
    let (status, _) = request(&running, "POST", "/validate", oversized).await;
    assert_eq!(status, 413);
    let (status, _) = request(&running, "GET", "/validate", Vec::new()).await;
    assert_eq!(status, 405);
    let (status, body) = request(&running, "GET", "/healthz", Vec::new()).await;
    assert_eq!((status, body.as_str()), (200, "ok"));

    assert_eq!(running.stats.reviews(), 1);
    assert_eq!(running.stats.bad_requests.load(Ordering::Relaxed), 2);
    let addr = running.addr;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(5), running.join())
        .await
        .expect("every task ends on stop");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "a stopped webhook is not listening"
    );
}

#[tokio::test]
async fn a_stop_closes_connections_kept_alive() {
    let (running, stop) = started().await;
    let ca = running.ca_bundle.as_ref().unwrap().borrow().clone();
    let tcp = TcpStream::connect(running.addr).await.unwrap();
    let mut tls = connector(&ca)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 64];
    let n = tls.read(&mut first).await.unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"));
    stop.send(true).unwrap();
    running.join().await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "the kept-alive connection is closed on stop");
}

/// Whether the certificate the webhook presents verifies against `ca_pem`.
async fn served_by(running: &Running, ca_pem: &str) -> bool {
    let tcp = TcpStream::connect(running.addr).await.unwrap();
    connector(ca_pem)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .is_ok()
}

#[tokio::test]
async fn a_rotation_puts_the_new_ca_in_the_bundle_before_serving_its_certificate() {
    let (stop, stopped) = watch::channel(false);
    let mut settings = Settings::new(
        "127.0.0.1:0".parse().unwrap(),
        CertSource::SelfSigned {
            hosts: vec!["127.0.0.1".into()],
            // Rotated at two thirds: after 2 s.
            validity: Duration::from_secs(3),
            webhook_configuration: None,
        },
    );
    settings.rotation_grace = Duration::from_millis(1500);
    let running = start(settings, None, stopped).await.unwrap();
    let mut bundle = running.ca_bundle.clone().unwrap();
    let first = bundle.borrow_and_update().clone();
    assert!(served_by(&running, &first).await);

    tokio::time::timeout(Duration::from_secs(10), bundle.changed())
        .await
        .expect("a new CA within the validity")
        .unwrap();
    let both = bundle.borrow_and_update().clone();
    assert_eq!(both.matches("BEGIN CERTIFICATE").count(), 2, "{both}");
    assert!(both.ends_with(&first), "the old CA stays in the bundle");
    let new_ca = both.strip_suffix(&first).unwrap().to_string();
    // During the grace the old certificate is still served: the API server may not have read the
    // new bundle yet.
    assert!(served_by(&running, &first).await);
    assert!(!served_by(&running, &new_ca).await);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert!(
        served_by(&running, &new_ca).await,
        "the new certificate after the grace"
    );
    assert!(served_by(&running, &both).await);
    stop.send(true).unwrap();
    running.join().await;
}
