//! A real node on this machine: containerd 2.4 and the kubelet v1.36.2 joined to a
//! [`ControlPlane`], so that a driver registers with, is prepared by, and hands its CDI devices to
//! the real components instead of the kubelet emulator. Root only: it mounts, makes namespaces and
//! cgroups.
//!
//! What this machine kind needs, and so what each setting below is for:
//! - cgroup v1/v2 hybrid: the kubelet runs with `failCgroupV1: false` and the cgroupfs driver, and
//!   containerd runs Debian's runc (crun refuses this host).
//! - no CAP_SYS_RESOURCE: containerd's `restrict_oom_score_adj`.
//! - the kubelet rewrites `vm.overcommit_memory`, `kernel.panic` and `kernel.panic_on_oops` and
//!   fails if it cannot: it runs in a mount namespace of its own (`unshare -m`), with files of the
//!   node's bound over those `/proc/sys` entries, so the host's settings are never touched.
//! - its `--root-dir` is a shared bind mount, so the volumes it mounts in its namespace (projected
//!   ServiceAccount tokens) reach containerd, which runs in the host's.
//! - no pod network: containerd refuses a sandbox without an address, so a CNI plugin of the node's
//!   (a shell script) puts both ends of a veth pair in the sandbox's namespace with an address and
//!   no connectivity. No cluster DNS either: pods say `dnsPolicy: Default`.
//! - images are imported (`ctr images import`), never pulled: pods say `imagePullPolicy: Never`.
//!
//! The plane runs without the node-lifecycle controller (its hand-made Nodes have no heartbeat), so
//! nothing would lift the `node.kubernetes.io/not-ready` taint the kubelet registers its Node
//! with: the node lifts it once the kubelet reports Ready, as that controller does.
//!
//! One real node at a time on a machine: kubelets share the host's `kubepods` cgroups.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use super::binaries::NodeBinaries;
use super::{flags, io_err, kube_err, nodes, write_private, ControlPlane, PlaneError};
use crate::harness::ManagedProcess;

/// How long the kubelet may take to report its Node Ready (1-2 s on an idle machine).
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// The CNI plugin: a veth pair inside the sandbox's own network namespace, and an address from the
/// container's id. The pod gets an IP, as containerd requires, and reaches nothing.
const CNI_PLUGIN: &str = r#"#!/bin/sh
# gpupool e2e: an address and no connectivity (this machine has no pod network).
set -eu
PATH="$PATH:/usr/sbin:/sbin:/usr/bin:/bin"
cat >/dev/null
case "${CNI_COMMAND:-}" in
VERSION)
  echo '{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0"]}' ;;
ADD)
  n=$(printf %s "$CNI_CONTAINERID" | cksum | cut -d' ' -f1)
  addr="10.244.$(( n / 250 % 250 )).$(( n % 250 + 2 ))"
  nsenter --net="$CNI_NETNS" ip link add "$CNI_IFNAME" type veth peer name gpupool-peer
  nsenter --net="$CNI_NETNS" ip addr add "$addr/32" dev "$CNI_IFNAME"
  nsenter --net="$CNI_NETNS" ip link set "$CNI_IFNAME" up
  nsenter --net="$CNI_NETNS" ip link set gpupool-peer up
  printf '{"cniVersion":"1.0.0","interfaces":[{"name":"%s","sandbox":"%s"}],"ips":[{"address":"%s/32","interface":0}]}\n' \
    "$CNI_IFNAME" "$CNI_NETNS" "$addr" ;;
DEL|CHECK|GC|STATUS) ;;
*) echo "{\"code\":4,\"msg\":\"unknown CNI_COMMAND ${CNI_COMMAND:-}\"}"; exit 1 ;;
esac
"#;
const CNI_PLUGIN_NAME: &str = "gpupool-e2e-veth";

/// The kubelet's entry into its own mount namespace: the namespace's copy of /proc is made
/// private first (so nothing bound below it can reach the host's, whatever its propagation), then
/// the node's sysctl files are bound over the three entries the kubelet writes.
const KUBELET_ENTRY: &str = r#"set -e
sysctl_dir=$1; shift
mount --make-rprivate /proc
mount --bind "$sysctl_dir/overcommit_memory" /proc/sys/vm/overcommit_memory
mount --bind "$sysctl_dir/panic" /proc/sys/kernel/panic
mount --bind "$sysctl_dir/panic_on_oops" /proc/sys/kernel/panic_on_oops
exec "$@""#;

/// The host's cgroup v1 hierarchies the kubelet makes `kubepods` in.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// A running containerd and kubelet for Node `name`; stopped, with every container, mount and
/// cgroup they made, when dropped.
pub struct RealNode {
    name: String,
    folders: NodeFolders,
    /// The kubelet's root folder, kept short: a driver's sockets lie three levels below it, named
    /// by its pod UID, and a socket path has at most 107 bytes.
    _kubelet_root: tempfile::TempDir,
    ctr: Ctr,
    kubelet: ManagedProcess,
    containerd: ManagedProcess,
    /// The `kubepods` cgroups there before this node: the others are removed when it stops.
    cgroups_before: BTreeSet<PathBuf>,
}

impl RealNode {
    /// Starts containerd and the kubelet for Node `name` under `dir`, and waits until the Node is
    /// Ready and schedulable. [`PlaneError::Unavailable`] says why this machine cannot run one.
    pub async fn start(
        plane: &ControlPlane,
        admin: &Client,
        binaries: &NodeBinaries,
        name: &str,
        dir: &Path,
    ) -> Result<RealNode, PlaneError> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(PlaneError::Unavailable(
                "a real node needs root (it mounts, makes namespaces and cgroups)".into(),
            ));
        }
        let runc = find_tool("runc", "Debian: apt-get install runc")?;
        for tool in ["unshare", "nsenter", "ip", "mount"] {
            find_tool(tool, "util-linux and iproute2")?;
        }
        let kubelet_root = tempfile::Builder::new()
            .prefix("gpupool-kl-")
            .tempdir()
            .map_err(io_err("creating the kubelet's root folder"))?;
        let node = NodeFolders::new(dir, kubelet_root.path());
        node.create()?;
        write_executable(&node.cni_bin.join(CNI_PLUGIN_NAME), CNI_PLUGIN)?;
        write_file(
            &node.cni_conf.join("10-gpupool-e2e.conflist"),
            &format!(
                r#"{{"cniVersion":"1.0.0","name":"gpupool-e2e","plugins":[{{"type":"{CNI_PLUGIN_NAME}"}}]}}"#
            ),
        )?;
        write_file(&node.containerd_config(), &containerd_config(&node, &runc))?;
        for (file, entry) in [
            ("overcommit_memory", "vm/overcommit_memory"),
            ("panic", "kernel/panic"),
            ("panic_on_oops", "kernel/panic_on_oops"),
        ] {
            let host = std::fs::read_to_string(Path::new("/proc/sys").join(entry))
                .map_err(io_err(format!("reading /proc/sys/{entry}")))?;
            write_file(&node.sysctl.join(file), &host)?;
        }
        let ports = super::free_loopback_ports(2)?;
        write_file(
            &node.kubelet_config(),
            &kubelet_config(&node, ports[0], ports[1]),
        )?;
        plane.node_kubeconfig(name, &node.kubelet_kubeconfig())?;

        let mut real = RealNode {
            name: name.to_string(),
            folders: NodeFolders::new(dir, kubelet_root.path()),
            _kubelet_root: kubelet_root,
            ctr: Ctr {
                program: binaries.ctr.clone(),
                socket: node.containerd_socket(),
            },
            kubelet: ManagedProcess::placeholder(),
            containerd: ManagedProcess::placeholder(),
            cgroups_before: kubepods_cgroups(),
        };
        // From here on a failure drops `real`, which undoes what was done.
        shared_bind_mount(&node.kubelet_root)?;

        let path = std::env::var("PATH").unwrap_or_default();
        real.containerd = ManagedProcess::new(
            &format!("containerd on {name}"),
            &binaries.containerd,
            vec![
                "--config".into(),
                node.containerd_config().display().to_string(),
            ],
            node.log("containerd"),
        )
        .env("PATH", format!("{}:{path}", binaries.shim_dir.display()))
        .started()?;
        let ctr = real.ctr.clone();
        real.wait_for("containerd to serve", || {
            let out = ctr.command(&["version"]).output().ok()?;
            out.status.success().then_some(())
        })
        .await?;
        for image in &binaries.images {
            let out = real
                .ctr
                .command(&["images", "import", &image.display().to_string()])
                .output()
                .map_err(io_err(format!("running {}", binaries.ctr.display())))?;
            if !out.status.success() {
                return Err(PlaneError::Unavailable(format!(
                    "ctr images import {}: {}",
                    image.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
        }

        let mut args = vec![
            "-m".to_string(),
            "--propagation".into(),
            "unchanged".into(),
            "sh".into(),
            "-c".into(),
            KUBELET_ENTRY.into(),
            "kubelet-entry".into(),
            node.sysctl.display().to_string(),
            binaries.kubelet.display().to_string(),
        ];
        args.extend(kubelet_args(&node, name));
        real.kubelet = ManagedProcess::new(
            &format!("kubelet on {name}"),
            Path::new("unshare"),
            args,
            node.log("kubelet"),
        )
        .started()?;

        let nodes: Api<Node> = Api::all(admin.clone());
        let ready = real
            .wait_for_async(&format!("Node {name} to be Ready"), || async {
                let node = nodes.get_opt(name).await.ok()??;
                let ready = node
                    .status
                    .as_ref()?
                    .conditions
                    .as_ref()?
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                ready.then_some(node)
            })
            .await;
        let ready = ready?;
        if let Some(patch) = nodes::without_not_ready_taint(&ready) {
            nodes
                .patch(name, &PatchParams::default(), &Patch::Merge(patch))
                .await
                .map_err(kube_err(format!("untainting Node {name}")))?;
        }
        Ok(real)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The kubelet's `--root-dir`: `plugins_registry/` (where drivers register) and `plugins/`.
    pub fn kubelet_root(&self) -> PathBuf {
        self.folders.kubelet_root.clone()
    }

    /// The folder where drivers put their registration sockets for the kubelet's plugin watcher.
    pub fn registry_dir(&self) -> PathBuf {
        self.kubelet_root().join("plugins_registry")
    }

    /// The folder a driver named `driver` serves its DRA socket in.
    pub fn plugin_dir(&self, driver: &str) -> PathBuf {
        self.kubelet_root().join("plugins").join(driver)
    }

    /// The folder containerd reads CDI specs from.
    pub fn cdi_dir(&self) -> PathBuf {
        self.folders.cdi.clone()
    }

    pub fn kubelet_log(&self) -> String {
        self.kubelet.log()
    }

    pub fn containerd_log(&self) -> String {
        self.containerd.log()
    }

    /// What container `container` of pod `namespace/pod` wrote (stdout and stderr, in order), from
    /// the kubelet's log files: with no pod network there is no `kubectl logs`. `None` before the
    /// container has started.
    pub fn container_output(&self, namespace: &str, pod: &str, container: &str) -> Option<String> {
        let logs = &self.folders.pod_logs;
        let prefix = format!("{namespace}_{pod}_");
        let pod_dir = std::fs::read_dir(logs)
            .ok()?
            .filter_map(|e| e.ok())
            .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))?
            .path();
        let log = std::fs::read_to_string(pod_dir.join(container).join("0.log")).ok()?;
        Some(cri_log_messages(&log))
    }

    async fn wait_for<T>(
        &mut self,
        what: &str,
        mut check: impl FnMut() -> Option<T>,
    ) -> Result<T, PlaneError> {
        self.wait_for_async(what, || std::future::ready(check()))
            .await
    }

    /// Polls `check` until it yields, failing early with its log if containerd or the kubelet
    /// has exited.
    async fn wait_for_async<T, Fut>(
        &mut self,
        what: &str,
        mut check: impl FnMut() -> Fut,
    ) -> Result<T, PlaneError>
    where
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(value) = check().await {
                return Ok(value);
            }
            for (component, process) in [
                ("containerd", &mut self.containerd),
                ("kubelet", &mut self.kubelet),
            ] {
                if let Some(status) = process.exit_status() {
                    return Err(PlaneError::Exited {
                        component,
                        status: status.to_string(),
                        log: log_tail(&process.log(), 30),
                    });
                }
            }
            if Instant::now() >= deadline {
                return Err(PlaneError::Timeout {
                    what: what.to_string(),
                    after: READY_TIMEOUT,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills every container this node's containerd runs (their shims outlive containerd).
    fn kill_containers(&self) {
        let Ok(out) = self.ctr.command(&["tasks", "ls", "--quiet"]).output() else {
            return;
        };
        let tasks: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(String::from)
            .collect();
        for task in &tasks {
            let _ = self
                .ctr
                .command(&["tasks", "kill", "--all", "--signal", "SIGKILL", task])
                .output();
        }
        for task in &tasks {
            let _ = self
                .ctr
                .command(&["tasks", "delete", "--force", task])
                .output();
        }
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        // The kubelet first, so that it restarts nothing; then the containers, then containerd.
        self.kubelet.kill();
        self.kill_containers();
        self.containerd.kill();
        kill_shims_of(&self.ctr.socket);
        unmount_under(&self.folders.kubelet_root);
        unmount_under(&self.folders.base);
        // Deepest first: a cgroup is removed only once it has no child.
        let mut cgroups: Vec<PathBuf> = Vec::new();
        for made in kubepods_cgroups().difference(&self.cgroups_before) {
            cgroups.extend(subdirs_depth_first(made));
        }
        for cgroup in cgroups {
            let _ = std::fs::remove_dir(&cgroup);
        }
    }
}

/// `ctr` on the node's containerd, in the CRI's namespace (`k8s.io`).
#[derive(Clone)]
struct Ctr {
    program: PathBuf,
    socket: PathBuf,
}

impl Ctr {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.program);
        command
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", "k8s.io"])
            .args(args);
        command
    }
}

/// The node's folders under its base.
struct NodeFolders {
    base: PathBuf,
    containerd: PathBuf,
    cni_bin: PathBuf,
    cni_conf: PathBuf,
    cdi: PathBuf,
    kubelet_root: PathBuf,
    pod_logs: PathBuf,
    sysctl: PathBuf,
}

impl NodeFolders {
    fn new(base: &Path, kubelet_root: &Path) -> NodeFolders {
        NodeFolders {
            base: base.to_path_buf(),
            containerd: base.join("containerd"),
            cni_bin: base.join("cni").join("bin"),
            cni_conf: base.join("cni").join("conf"),
            cdi: base.join("cdi"),
            kubelet_root: kubelet_root.to_path_buf(),
            pod_logs: base.join("pod-logs"),
            sysctl: base.join("sysctl"),
        }
    }

    fn create(&self) -> Result<(), PlaneError> {
        for dir in [
            &self.containerd,
            &self.cni_bin,
            &self.cni_conf,
            &self.cdi,
            &self.kubelet_root,
            &self.pod_logs,
            &self.sysctl,
        ] {
            std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        }
        Ok(())
    }

    fn containerd_config(&self) -> PathBuf {
        self.containerd.join("config.toml")
    }

    fn containerd_socket(&self) -> PathBuf {
        self.containerd.join("containerd.sock")
    }

    fn kubelet_config(&self) -> PathBuf {
        self.base.join("kubelet-config.yaml")
    }

    fn kubelet_kubeconfig(&self) -> PathBuf {
        self.base.join("kubelet.kubeconfig")
    }

    fn log(&self, component: &str) -> PathBuf {
        self.base.join(format!("{component}.log"))
    }
}

/// containerd's configuration (version 3, which 2.4 migrates on load): its own root, state and
/// sockets under the node's folder, CRI with CDI from the node's CDI folder, runc, the node's CNI
/// plugin, and the imported pause image as the sandbox image.
fn containerd_config(node: &NodeFolders, runc: &Path) -> String {
    let containerd = node.containerd.display();
    let socket = node.containerd_socket();
    let socket = socket.display();
    format!(
        r#"version = 3
root = "{containerd}/root"
state = "{containerd}/state"

[plugins.'io.containerd.server.v1.grpc']
  address = "{socket}"

[plugins.'io.containerd.server.v1.ttrpc']
  address = "{socket}.ttrpc"

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["{cdi}"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true

  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"

    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false

  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
    use_internal_loopback = true

[plugins.'io.containerd.cri.v1.images']
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
"#,
        cdi = node.cdi.display(),
        runc = runc.display(),
        cni_bin = node.cni_bin.display(),
        cni_conf = node.cni_conf.display(),
    )
}

/// The sandbox image, as the node's `images/pause.tar` names it.
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10";

/// The kubelet's configuration: the plane's feature gates, containerd's socket, loopback ports,
/// no authentication of its own API (no one calls it), and nothing that would evict the tests'
/// pods on a busy disk.
fn kubelet_config(node: &NodeFolders, port: u16, healthz_port: u16) -> String {
    let gates: String = flags::FEATURE_GATES
        .iter()
        .map(|gate| format!("  {gate}: true\n"))
        .collect();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{socket}
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz_port}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
authorization: {{mode: AlwaysAllow}}
podLogsDir: {pod_logs}
failSwapOn: false
evictionHard: {{}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
makeIPTablesUtilChains: false
localStorageCapacityIsolation: false
featureGates:
{gates}"#,
        socket = node.containerd_socket().display(),
        pod_logs = node.pod_logs.display(),
    )
}

fn kubelet_args(node: &NodeFolders, name: &str) -> Vec<String> {
    vec![
        "--config".into(),
        node.kubelet_config().display().to_string(),
        "--kubeconfig".into(),
        node.kubelet_kubeconfig().display().to_string(),
        "--root-dir".into(),
        node.kubelet_root.display().to_string(),
        "--cert-dir".into(),
        node.base.join("kubelet-pki").display().to_string(),
        "--hostname-override".into(),
        name.into(),
        // The next turn on the plane removes the Node, as it removes hand-made ones: without the
        // node-lifecycle controller a stopped kubelet's Node would stay Ready and schedulable.
        "--node-labels".into(),
        format!("{}=true", nodes::HAND_MADE_LABEL),
        "--v".into(),
        "2".into(),
    ]
}

/// The messages of a CRI log file (`<time> <stream> <F|P> <message>` per line), joined: partial
/// lines (`P`) are continued by the next.
pub fn cri_log_messages(log: &str) -> String {
    let mut out = String::new();
    for line in log.lines() {
        let mut fields = line.splitn(4, ' ');
        let (Some(_time), Some(_stream), Some(tag)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        out.push_str(fields.next().unwrap_or(""));
        if tag != "P" {
            out.push('\n');
        }
    }
    out
}

fn find_tool(name: &str, from: &str) -> Result<PathBuf, PlaneError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            PlaneError::Unavailable(format!("a real node needs {name} on the PATH ({from})"))
        })
}

fn write_file(path: &Path, contents: &str) -> Result<(), PlaneError> {
    std::fs::write(path, contents).map_err(io_err(format!("writing {}", path.display())))
}

fn write_executable(path: &Path, contents: &str) -> Result<(), PlaneError> {
    use std::os::unix::fs::PermissionsExt;
    write_private(path, contents)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .map_err(io_err(format!("making {} executable", path.display())))
}

/// Binds `dir` onto itself and makes it a shared mount, so that mounts made below it in another
/// mount namespace (the kubelet's) appear in this one (containerd's).
fn shared_bind_mount(dir: &Path) -> Result<(), PlaneError> {
    for args in [["--bind", "", ""], ["--make-shared", "", ""]] {
        let mut command = Command::new("mount");
        command.arg(args[0]).arg(dir);
        if args[0] == "--bind" {
            command.arg(dir);
        }
        let out =
            command
                .output()
                .map_err(io_err(format!("mount {} {}", args[0], dir.display())))?;
        if !out.status.success() {
            return Err(PlaneError::Unavailable(format!(
                "mount {} {}: {}",
                args[0],
                dir.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    Ok(())
}

/// Detaches every mount at or below `dir`, deepest first.
fn unmount_under(dir: &Path) {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|point| PathBuf::from(point.replace("\\040", " ")))
        .filter(|point| point.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in points {
        let Ok(c_path) = std::ffi::CString::new(point.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: a valid NUL-terminated path; MNT_DETACH never blocks.
        unsafe {
            libc::umount2(c_path.as_ptr(), libc::MNT_DETACH);
        }
    }
}

/// SIGKILLs the runc shims that serve the containerd at `socket` (a shim outlives containerd).
fn kill_shims_of(socket: &Path) {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    let socket = socket.display().to_string();
    for entry in procs.filter_map(|e| e.ok()) {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_shim = args
            .first()
            .is_some_and(|a| a.ends_with(super::binaries::CONTAINERD_SHIM));
        if is_shim && args.iter().any(|a| a == &socket) {
            // SAFETY: plain kill(2) of a process whose command line names this node's socket.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// Every `kubepods*` cgroup folder at the top of the host's hierarchies.
fn kubepods_cgroups() -> BTreeSet<PathBuf> {
    let Ok(hierarchies) = std::fs::read_dir(CGROUP_ROOT) else {
        return BTreeSet::new();
    };
    hierarchies
        .filter_map(|e| e.ok())
        .filter_map(|hierarchy| std::fs::read_dir(hierarchy.path()).ok())
        .flat_map(|entries| entries.filter_map(|e| e.ok()))
        .filter(|e| e.file_name().to_string_lossy().starts_with("kubepods"))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// `dir` and every folder below it, children before their parents.
fn subdirs_depth_first(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.filter_map(|e| e.ok()) {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(subdirs_depth_first(&entry.path()));
            }
        }
    }
    out.push(dir.to_path_buf());
    out
}

fn log_tail(log: &str, lines: usize) -> String {
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cri_log_gives_the_containers_lines_with_partial_lines_joined() {
        let log = "2026-12-05T16:10:03.5Z stdout F CUDA_DEVICE_SM_LIMIT_0=50\n\
                   2026-12-05T16:10:03.6Z stderr P half \n\
                   2026-12-05T16:10:03.7Z stderr F a line\n\
                   garbage\n";
        assert_eq!(
            cri_log_messages(log),
            "CUDA_DEVICE_SM_LIMIT_0=50\nhalf a line\n"
        );
    }

    #[test]
    fn the_kubelet_config_carries_every_gate_of_the_plane() {
        let node = NodeFolders::new(Path::new("/n"), Path::new("/k"));
        let config: serde_json::Value =
            serde_yaml::from_str(&kubelet_config(&node, 1, 2)).expect("YAML");
        for gate in flags::FEATURE_GATES {
            assert_eq!(config["featureGates"][gate], true, "{gate}");
        }
        assert_eq!(
            config["containerRuntimeEndpoint"],
            "unix:///n/containerd/containerd.sock"
        );
        assert_eq!(config["failCgroupV1"], false);
    }
}
