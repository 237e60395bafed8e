//! The real driver against grpc-go, the library the kubelet is built on, dialing the sockets the way
//! the kubelet does (e2e/go/grpc-client). The kubelet emulator is Rust and tonic: a server can agree
//! with it and still refuse the real kubelet, as the driver once did with every registration (grpc-go
//! sends the socket path as `:authority` there, percent-encoded from grpc-go 1.57 on; tonic's client
//! sends `localhost`).
//!
//! The client is built offline against Debian's grpc-go (`apt-get install golang-go
//! golang-google-grpc-dev`); without either the tests say so and skip.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use gpupool_api::names::DRIVER_NAME;
use gpupool_apiserver::ApiServer;
use gpupool_e2e::harness::process::{assert_succeeded, offline_go};
use gpupool_e2e::harness::{
    cleanup, find_binary, service_account_kubeconfig, start_api_emulator, wait_for, workspace_root,
    ManagedProcess, NodeDirs, DRIVER_BIN, DRIVER_SERVICE_ACCOUNT,
};
use serde_json::Value;

const NODE: &str = "node-grpc-go";
const FAKE_GPUS: &str = "a100-40gb:2";
const GPUS: usize = 2;

/// Where golang-google-grpc-dev installs grpc-go and its dependencies: GOPATH mode finds them there,
/// so the build needs no module proxy (CI reaches none).
const DEBIAN_GOPATH: &str = "/usr/share/gocode";

/// The built client, or why the test skips. A client that does not compile is a failure, not a
/// reason to skip.
fn go_client(test: &str) -> Option<PathBuf> {
    static CLIENT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match CLIENT.get_or_init(build_go_client) {
        Ok(path) => Some(path.clone()),
        Err(reason) => {
            println!("skipping {test}: {reason}");
            None
        }
    }
}

fn build_go_client() -> Result<PathBuf, String> {
    let go_works = Command::new("go")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !go_works {
        return Err("go is not installed (apt-get install golang-go)".into());
    }
    if !Path::new(DEBIAN_GOPATH)
        .join("src/google.golang.org/grpc")
        .is_dir()
    {
        return Err(format!(
            "grpc-go is not installed in {DEBIAN_GOPATH} (apt-get install golang-google-grpc-dev)"
        ));
    }
    let dir = tempfile::Builder::new()
        .prefix("gpupool-grpc-go-")
        .tempdir()
        .expect("creating the Go client's folder")
        .keep();
    cleanup::remove_at_exit(dir.clone());
    let binary = dir.join("grpc-client");
    let out = offline_go(&workspace_root().join("e2e/go/grpc-client"))
        .arg("build")
        .arg("-o")
        .arg(&binary)
        .arg(".")
        .env("GO111MODULE", "off")
        .env("GOPATH", DEBIAN_GOPATH)
        .output()
        .expect("running go build");
    assert_succeeded(&out, "go build in e2e/go/grpc-client failed");
    Ok(binary)
}

/// Runs the client; grpc-go's own timeouts end it sooner than this.
async fn run_client(client: &Path, args: &[&str]) -> Output {
    let child = tokio::process::Command::new(client)
        .args(args)
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(Duration::from_secs(60), child)
        .await
        .unwrap_or_else(|_| panic!("grpc-client {args:?} still running after 60 s"))
        .expect("running grpc-client")
}

fn stdout_json(output: &Output, what: &str) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "{what}: stdout is not JSON ({e}):\n{}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// One node: the API server emulator and the real driver with fake GPUs, and no kubelet emulator,
/// so that the Go client is the only kubelet the driver meets.
struct Node {
    _apiserver: ApiServer,
    dirs: NodeDirs,
    driver: ManagedProcess,
    _root: tempfile::TempDir,
}

impl Node {
    async fn start() -> Node {
        let root = tempfile::Builder::new()
            .prefix("gpupool-grpc-go-node-")
            .tempdir()
            .expect("creating the node's folder");
        let kubeconfig = root.path().join("kubeconfig");
        let apiserver = start_api_emulator(&kubeconfig)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let driver_kubeconfig =
            service_account_kubeconfig(&apiserver, root.path(), DRIVER_SERVICE_ACCOUNT, Some(NODE))
                .unwrap_or_else(|e| panic!("{e}"));
        let host = root.path().join("host");
        let dirs = NodeDirs::under(&host);
        let libs = host.join("libs");
        for dir in [&dirs.registry, &dirs.plugin, &dirs.cdi, &dirs.state, &libs] {
            std::fs::create_dir_all(dir).expect("creating the node's folders");
        }
        let binary = find_binary(DRIVER_BIN).unwrap_or_else(|e| panic!("{e}"));
        let driver = ManagedProcess::spawn(
            &format!("{DRIVER_BIN} on {NODE}"),
            &binary,
            dirs.driver_run_args(NODE, &driver_kubeconfig, FAKE_GPUS, &libs),
            root.path().join("driver.log"),
        )
        .expect("starting the driver");
        let node = Node {
            _apiserver: apiserver,
            dirs,
            driver,
            _root: root,
        };
        // The registration socket is bound after the DRA socket: once it is there, both are.
        if let Err(e) = wait_for(
            "the driver's registration socket",
            Duration::from_secs(30),
            || async { node.registration_socket() },
        )
        .await
        {
            panic!("{e}\n--- driver log ---\n{}", node.driver.log());
        }
        node
    }

    /// The socket the kubelet's plugin watcher would find: any `*-reg.sock` in the registry folder.
    fn registration_socket(&self) -> Option<PathBuf> {
        std::fs::read_dir(&self.dirs.registry)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_str().is_some_and(|p| p.ends_with("-reg.sock")))
    }

    fn dra_socket(&self) -> PathBuf {
        self.dirs.plugin.join("dra.sock")
    }
}

/// What the rest leans on: the client puts on the wire what the kubelet does, the socket path on
/// the registration socket and `localhost` on the DRA socket.
#[tokio::test]
async fn grpc_go_client_sends_the_kubelets_authorities() {
    let Some(client) = go_client("grpc_go_client_sends_the_kubelets_authorities") else {
        return;
    };
    for mode in ["register", "register-encoded", "dra"] {
        let dir = tempfile::tempdir().expect("creating a probe folder");
        let probe = dir.path().join("probe.sock").display().to_string();
        // Temp paths hold nothing else that needs escaping.
        let expected = match mode {
            "register" => probe.clone(),
            "register-encoded" => probe.replace('/', "%2F"),
            _ => "localhost".to_string(),
        };
        let dir = dir.path().display().to_string();
        let out = run_client(&client, &["authority", mode, &dir]).await;
        assert!(
            out.status.success(),
            "grpc-client authority {mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let seen = stdout_json(&out, mode);
        assert_eq!(seen["authority"], expected.as_str(), "{mode}: {seen}");
    }
}

/// The kubelet's registration as grpc-go before 1.57 sends it (the installed one): GetInfo with the
/// socket path as `:authority`, then NotifyRegistrationStatus.
#[tokio::test]
async fn grpc_go_registers_the_driver_with_the_path_as_authority() {
    let test = "grpc_go_registers_the_driver_with_the_path_as_authority";
    if let Some(client) = go_client(test) {
        registers(&client, "register").await;
    }
}

/// The same as grpc-go 1.57 and later sends it (kubelets of recent years): the path percent-encoded.
#[tokio::test]
async fn grpc_go_registers_the_driver_with_the_encoded_path_as_authority() {
    let test = "grpc_go_registers_the_driver_with_the_encoded_path_as_authority";
    if let Some(client) = go_client(test) {
        registers(&client, "register-encoded").await;
    }
}

/// `mode`: the Go client's registration mode. Each runs against a driver of its own.
async fn registers(client: &Path, mode: &str) {
    let node = Node::start().await;
    let socket = node
        .registration_socket()
        .expect("Node::start waited for it");
    let out = run_client(client, &[mode, &socket.display().to_string()]).await;
    assert!(
        out.status.success(),
        "grpc-go ({mode}) could not register the driver over {} (the kubelet retries this with \
         backoff and never registers the plugin):\n{}\n--- driver log ---\n{}",
        socket.display(),
        String::from_utf8_lossy(&out.stderr),
        node.driver.log()
    );
    let info = stdout_json(&out, mode);
    assert_eq!(info["type"], "DRAPlugin", "{info}");
    assert_eq!(info["name"], DRIVER_NAME, "{info}");
    assert_eq!(
        info["endpoint"],
        node.dra_socket().display().to_string(),
        "{info}"
    );
    let versions: Vec<&str> = info["supported_versions"]
        .as_array()
        .map(|v| v.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    assert!(versions.contains(&"v1.DRAPlugin"), "{info}");
    // NotifyRegistrationStatus{plugin_registered: true} reached the driver, not just the socket.
    wait_for(
        "the driver to log its registration",
        Duration::from_secs(10),
        || async {
            node.driver
                .log()
                .contains("registered with kubelet")
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n--- driver log ---\n{}", node.driver.log()));
}

/// The kubelet's DRA client (`unix:` target, `localhost` authority): the health stream it opens
/// right after registration, and an unprepare.
#[tokio::test]
async fn grpc_go_watches_health_and_unprepares_on_the_dra_socket() {
    let Some(client) = go_client("grpc_go_watches_health_and_unprepares_on_the_dra_socket") else {
        return;
    };
    let node = Node::start().await;
    let socket = node.dra_socket();
    let out = run_client(&client, &["dra", &socket.display().to_string()]).await;
    assert!(
        out.status.success(),
        "grpc-go on the DRA socket {}:\n{}\n--- driver log ---\n{}",
        socket.display(),
        String::from_utf8_lossy(&out.stderr),
        node.driver.log()
    );
    let result = stdout_json(&out, "DRA calls");
    let health = result["health"].as_array().expect("a device list");
    let devices: BTreeSet<&str> = health
        .iter()
        .filter_map(|d| d["device_name"].as_str())
        .collect();
    let expected: BTreeSet<String> = (0..GPUS as u32)
        .map(gpupool_api::names::device_name)
        .collect();
    assert_eq!(
        devices,
        expected.iter().map(String::as_str).collect(),
        "{result}"
    );
    for device in health {
        assert_eq!(device["pool_name"], NODE, "{result}");
        assert_eq!(device["health"], "HEALTHY", "{result}");
    }
    assert_eq!(
        result["unprepare"],
        serde_json::json!({}),
        "unprepare of no claims: {result}"
    );
}
