//! Metrics as an operator sees them: the drivers' and the controller's `/metrics` pass
//! `promtool check metrics`, and Debian's real Prometheus server, scraping a cluster of fake GPUs,
//! answers PromQL with what the claims allocated, back to nothing once the pods are gone.
//!
//! Both need Debian's `prometheus` package (`promtool`, `prometheus`); without it they say so and
//! skip.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::*;
use gpupool_api::quantity;
use gpupool_e2e::harness::objects::Request;
use gpupool_e2e::harness::{wait_for, ClusterSpec, TestCluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const GIB: u64 = 1 << 30;

/// `name` on the PATH; without it the test says it skips for want of `what`.
fn tool(name: &str, what: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        eprintln!("skipped: {what} not found (Debian package `prometheus`)");
    }
    found
}

/// A plain HTTP/1.1 GET on loopback: (status, body).
async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .map_err(|_| std::io::Error::other("timed out"))??;
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"));
    Ok((
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_string()
        },
    ))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every endpoint of the cluster: (what, address).
fn endpoints(cluster: &TestCluster) -> Vec<(String, SocketAddr)> {
    let mut out: Vec<(String, SocketAddr)> = cluster
        .nodes()
        .iter()
        .map(|n| {
            let addr = n
                .metrics_addr()
                .unwrap_or_else(|| panic!("the driver on {} logged no metrics address", n.name));
            (format!("driver on {}", n.name), addr)
        })
        .collect();
    out.push((
        "controller".into(),
        cluster
            .controller_metrics_addr()
            .expect("the controller logged no metrics address"),
    ));
    out
}

async fn start_cluster(nodes: &[(&str, &str)]) -> TestCluster {
    let mut spec = ClusterSpec::new().with_controller();
    for (name, gpus) in nodes {
        spec = spec.node(name, gpus);
    }
    // Metrics addresses come from the logs of processes the harness started.
    let cluster = start(spec.emulated()).await;
    apply_device_class(&cluster).await;
    cluster
}

/// A share to claim: (claim and pod name, node, device, cards on the node, memory, cores).
type Share<'a> = (&'a str, &'a str, &'a str, usize, &'a str, &'a str);

/// A claim for part of one card, pinned to it, and a pod that uses it; returns once the pod runs.
async fn claim_and_run(cluster: &TestCluster, namespace: &str, share: Share<'_>) {
    let (name, node, device, cards, memory, cores) = share;
    let uuid = device_uuid(cluster, node, device, cards).await;
    let request = Request::new("gpu").on(&uuid).memory(memory).cores(cores);
    apply_claim_and_pod(cluster, namespace, name, &[request]).await;
    wait_pod_running(cluster, namespace, name).await;
}

#[test]
fn promtool_finds_nothing_to_lint_in_the_driver_and_controller_expositions() {
    let Some(promtool) = tool("promtool", "promtool") else {
        return;
    };
    gpupool_e2e::harness::shared_runtime().block_on(async {
        let cluster = start_cluster(&[("node-lint", "a100-40gb:1")]).await;
        let _logs = cluster.logs_on_failure();
        let namespace = cluster.create_namespace("lint").await.unwrap();
        // A prepared share, so that the per-share families have samples to lint too.
        claim_and_run(
            &cluster,
            &namespace,
            ("half", "node-lint", "gpu-0", 1, "1Gi", "50"),
        )
        .await;
        wait_for("the controller's first pass", TIMEOUT, || async {
            let addr = cluster.controller_metrics_addr()?;
            let (_, body) = http_get(addr, "/metrics").await.ok()?;
            body.contains("gpupool_model_devices{").then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));

        for (what, addr) in endpoints(&cluster) {
            let (status, body) = http_get(addr, "/metrics")
                .await
                .unwrap_or_else(|e| panic!("GET {addr}/metrics of the {what}: {e}"));
            assert_eq!(status, 200, "{what}: {body}");
            let mut child = tokio::process::Command::new(&promtool)
                .args(["check", "metrics"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting promtool");
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(body.as_bytes()).await.unwrap();
            drop(stdin);
            let out = child.wait_with_output().await.unwrap();
            assert!(
                out.status.success(),
                "promtool check metrics on the {what}'s /metrics: {}{}\n--- exposition ---\n{body}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            eprintln!(
                "promtool: the {what}'s /metrics ({} lines) is clean",
                body.lines().count()
            );
        }
    });
}

/// Debian's Prometheus server on a free loopback port, scraping `targets` every second.
struct Prometheus {
    addr: SocketAddr,
    _child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(binary: &Path, drivers: &[SocketAddr], controller: SocketAddr) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let list = |addrs: &[SocketAddr]| {
            addrs
                .iter()
                .map(|a| format!("'{a}'"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n\
             - job_name: gpupool-driver\n  static_configs:\n  - targets: [{}]\n\
             - job_name: gpupool-controller\n  static_configs:\n  - targets: [{}]\n",
            list(drivers),
            list(&[controller])
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let addr = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = tokio::process::Command::new(binary)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("starting prometheus");
        let prometheus = Prometheus {
            addr,
            _child: child,
            _dir: dir,
        };
        wait_for(
            "prometheus to be ready",
            Duration::from_secs(60),
            || async {
                let (status, _) = http_get(prometheus.addr, "/-/ready").await.ok()?;
                (status == 200).then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n--- prometheus log ---\n{}", prometheus.log()));
        prometheus
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// An instant query's vector: each sample's labels and value.
    async fn query(&self, promql: &str) -> Vec<(BTreeMap<String, String>, f64)> {
        let path = format!("/api/v1/query?query={}", url_encode(promql));
        let Ok((200, body)) = http_get(self.addr, &path).await else {
            return Vec::new();
        };
        let value: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        value["data"]["result"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|sample| {
                let labels = sample["metric"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect();
                let number = sample["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(f64::NAN);
                (labels, number)
            })
            .collect()
    }

    /// Waits until `promql`, as `label -> value`, equals `expected`.
    async fn wait_for_values(&self, promql: &str, label: &str, expected: &BTreeMap<String, f64>) {
        let last = std::sync::Mutex::new(BTreeMap::new());
        let found = wait_for(&format!("`{promql}` == {expected:?}"), TIMEOUT, || async {
            let now: BTreeMap<String, f64> = self
                .query(promql)
                .await
                .into_iter()
                .map(|(labels, v)| (labels.get(label).cloned().unwrap_or_default(), v))
                .collect();
            let matches = &now == expected;
            *last.lock().unwrap() = now;
            matches.then_some(())
        })
        .await;
        if let Err(e) = found {
            panic!(
                "{e}; Prometheus said {:?}\n--- prometheus log ---\n{}",
                last.lock().unwrap(),
                self.log()
            );
        }
    }
}

/// Memory each of the namespace's claims was allocated, summed per model of the card it got.
async fn allocated_per_model(cluster: &TestCluster, namespace: &str) -> BTreeMap<String, f64> {
    let claims = kube::Api::<k8s_openapi::api::resource::v1::ResourceClaim>::namespaced(
        cluster.client(),
        namespace,
    )
    .list(&Default::default())
    .await
    .unwrap()
    .items;
    let mut per_model = BTreeMap::new();
    for claim in &claims {
        for r in allocation_results(claim) {
            let memory = r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|q| quantity::parse(&q.0).unwrap().ceil_units() as f64)
                .expect("a capacity request is consumed");
            let model = model_of(cluster, &r.pool, &r.device).await;
            *per_model.entry(model).or_insert(0.0) += memory;
        }
    }
    per_model
}

#[test]
fn prometheus_sees_allocation_per_model_and_prepared_claims_return_to_zero() {
    let Some(prometheus) = tool("prometheus", "the prometheus server") else {
        return;
    };
    gpupool_e2e::harness::shared_runtime().block_on(async {
        let cluster =
            start_cluster(&[("node-a100", "a100-40gb:2"), ("node-v100", "v100-32gb:1")]).await;
        let _logs = cluster.logs_on_failure();
        let addrs = endpoints(&cluster);
        let (drivers, controller): (Vec<_>, Vec<_>) = addrs
            .iter()
            .partition(|(what, _)| what.starts_with("driver"));
        let drivers: Vec<SocketAddr> = drivers.iter().map(|(_, a)| *a).collect();
        let server = Prometheus::start(&prometheus, &drivers, controller[0].1).await;

        let up: BTreeMap<String, f64> = addrs.iter().map(|(_, a)| (a.to_string(), 1.0)).collect();
        server.wait_for_values("up", "instance", &up).await;

        let namespace = cluster.create_namespace("prom").await.unwrap();
        let shares: [Share; 4] = [
            ("train", "node-a100", "gpu-0", 2, "4Gi", "50"),
            ("serve", "node-a100", "gpu-0", 2, "2Gi", "25"),
            ("other", "node-a100", "gpu-1", 2, "8Gi", "30"),
            ("infer", "node-v100", "gpu-0", 1, "6Gi", "70"),
        ];
        for share in shares {
            claim_and_run(&cluster, &namespace, share).await;
        }

        let expected = allocated_per_model(&cluster, &namespace).await;
        assert_eq!(expected.values().sum::<f64>(), (20 * GIB) as f64);
        server
            .wait_for_values(
                "sum by (model) (gpupool_gpu_memory_allocated_bytes)",
                "model",
                &expected,
            )
            .await;
        let prepared = BTreeMap::from([(String::new(), shares.len() as f64)]);
        server
            .wait_for_values("sum(gpupool_prepared_claims)", "", &prepared)
            .await;
        // Two shares of one card: their SM limits add up on it.
        server
            .wait_for_values(
                "gpupool_gpu_cores_allocated_percent{gpu=\"gpu-0\",model=\"A100-SXM4-40GB\"}",
                "gpu",
                &BTreeMap::from([("gpu-0".to_string(), 75.0)]),
            )
            .await;
        server
            .wait_for_values(
                "sum by (model) (gpupool_model_devices)",
                "model",
                &BTreeMap::from([
                    ("A100-SXM4-40GB".to_string(), 2.0),
                    ("V100-SXM2-32GB".to_string(), 1.0),
                ]),
            )
            .await;

        for (name, ..) in shares {
            delete_pod(&cluster, &namespace, name).await;
        }
        let none = BTreeMap::from([(String::new(), 0.0)]);
        server
            .wait_for_values("sum(gpupool_prepared_claims)", "", &none)
            .await;
        server
            .wait_for_values("sum(gpupool_gpu_memory_allocated_bytes)", "", &none)
            .await;
        let unprepared = BTreeMap::from([(String::new(), shares.len() as f64)]);
        server
            .wait_for_values(
                "sum(gpupool_unprepare_requests_total{result=\"success\"})",
                "",
                &unprepared,
            )
            .await;
        let failed = server
            .query("sum(gpupool_prepare_requests_total{result=\"error\"})")
            .await;
        assert_eq!(failed.first().map(|(_, v)| *v), Some(0.0));
        // The drivers publish slices and read claims: successful requests are counted by verb.
        let api = server
            .query(
                "sum by (verb) (gpupool_api_requests_total{job=\"gpupool-driver\",code=~\"2..\"})",
            )
            .await;
        assert!(
            api.iter().any(|(_, v)| *v > 0.0),
            "no API request counted: {api:?}"
        );
    });
}
