//! Runs the built `gpupool-controller` binary the way an operator (and the e2e harness) does.

use std::path::Path;
use std::process::Command;

const REGENERATE: &str =
    "regenerate with: cargo run -p gpupool-controller -- crds --dir deploy/crds";

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpupool-controller"))
}

#[test]
fn crds_output_matches_the_files_in_deploy() {
    let output = binary()
        .arg("crds")
        .output()
        .expect("run gpupool-controller crds");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let printed = String::from_utf8(output.stdout).unwrap();

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
    let mut expected = String::new();
    for file in [
        "gpumodels.gpupool.dev.yaml",
        "computeprofiles.gpupool.dev.yaml",
    ] {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; {REGENERATE}", path.display()));
        expected.push_str("---\n");
        expected.push_str(&text);
    }
    assert!(
        printed == expected,
        "deploy/crds drifted from the types in api/src/crd.rs; {REGENERATE}"
    );
}

#[test]
fn crds_output_is_two_crd_documents() {
    let output = binary().arg("crds").output().unwrap();
    let printed = String::from_utf8(output.stdout).unwrap();
    let kinds: Vec<String> = serde_yaml::Deserializer::from_str(&printed)
        .map(|doc| {
            let value = serde_yaml::Value::deserialize(doc).unwrap();
            format!(
                "{}/{}",
                value["kind"].as_str().unwrap(),
                value["spec"]["names"]["kind"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "CustomResourceDefinition/GpuModel",
            "CustomResourceDefinition/ComputeProfile"
        ]
    );
}

use serde::Deserialize;

#[test]
fn unknown_subcommand_fails_with_usage() {
    let output = binary().arg("bogus").output().unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("Usage"));
}

/// The binary as the harness runs it: against the emulator, installs the CRDs, manages a class, and on
/// SIGTERM hands the lease back so that another replica takes over at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_manages_classes_and_releases_the_lease_on_sigterm() {
    use gpupool_api::crd::{GpuModel, GpuModelSpec};
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::resource::v1::DeviceClass;
    use kube::api::{Api, PostParams};
    use std::time::Duration;

    let server = gpupool_apiserver::ApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig).unwrap();
    let log = dir.path().join("controller.log");
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpupool-controller"))
        .args(["run", "--install-crds", "--identity", "cli-test"])
        .args(["--lease-duration", "3s", "--renew-interval", "500ms"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--log-format", "json"])
        // Another run of this test may hold the default port.
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let client = server.client().await;
    let gpumodels = Api::<GpuModel>::all(client.clone());
    let classes = Api::<DeviceClass>::all(client.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    // The CRD is installed by the controller itself.
    while gpumodels
        .create(
            &PostParams::default(),
            &GpuModel::new(
                "h100",
                GpuModelSpec {
                    model: Some("H100-SXM5-80GB".into()),
                    product_name: None,
                    compute_weight: 989,
                    device_class_name: None,
                    tier: None,
                    mig_profiles: Vec::new(),
                },
            ),
        )
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "CRDs never installed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    while classes
        .get_opt("h100-sxm5-80gb.gpupool.dev")
        .await
        .unwrap()
        .is_none()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "class never created"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Each replica names itself in its User-Agent, so writes can be told apart.
    let ours = server
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.user_agent.contains("(cli-test)"))
        .count();
    assert!(ours > 0, "no request carried the controller's User-Agent");

    let pid = child.id().unwrap().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}\n{}", log_text());
    let lease = Api::<Lease>::namespaced(client, "kube-system")
        .get("gpupool-controller")
        .await
        .unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity,
        None,
        "lease not released"
    );
}

/// Whether the HTTPS server at `port` answers GET /healthz with a certificate `ca_pem` verifies.
async fn healthz_verified_by(port: u16, ca_pem: &str) -> bool {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let Ok(tcp) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let Ok(mut tls) = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
    else {
        return false;
    };
    let request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    if tls.write_all(request).await.is_err() {
        return false;
    }
    let mut response = Vec::new();
    let _ = tls.read_to_end(&mut response).await;
    response.starts_with(b"HTTP/1.1 200")
}

/// `webhook` with a Secret's pair (cert-manager's mode): served, and a renewed pair is served
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_serves_certificate_files_and_reloads_them_when_renewed() {
    use gpupool_controller::webhook::certs::self_signed;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let write_pair = |pair: &gpupool_controller::webhook::certs::SelfSigned| {
        // As the kubelet updates a Secret volume: the new files appear whole.
        for (path, text) in [(&cert, &pair.cert_pem), (&key, &pair.key_pem)] {
            let next = path.with_extension("new");
            std::fs::write(&next, text).unwrap();
            std::fs::rename(&next, path).unwrap();
        }
    };
    let first = self_signed(&["127.0.0.1".into()], Duration::from_secs(3600)).unwrap();
    write_pair(&first);
    // A key any user may read, which the webhook must point out.
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpupool-controller"))
        .arg("webhook")
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg("--tls-cert-file")
        .arg(&cert)
        .arg("--tls-key-file")
        .arg(&key)
        .arg("--tls-reload-interval=200ms")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !healthz_verified_by(port, &first.ca_pem).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the webhook never served its files"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let renewed = self_signed(&["127.0.0.1".into()], Duration::from_secs(3600)).unwrap();
    write_pair(&renewed);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !healthz_verified_by(port, &renewed.ca_pem).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the renewed pair was never served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!healthz_verified_by(port, &first.ca_pem).await);
    child.kill().await.unwrap();
    let log = child.wait_with_output().await.unwrap().stderr;
    let log = String::from_utf8_lossy(&log);
    // Said at start.
    assert!(
        log.contains("the webhook's private key is readable by other users"),
        "{log}"
    );
}

#[test]
fn webhook_needs_both_certificate_files() {
    let output = binary()
        .args(["webhook", "--tls-cert-file", "/nonexistent/tls.crt"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--tls-key-file"), "{stderr}");
}
