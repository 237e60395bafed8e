//! gpupool's image as `deploy/Containerfile` builds it, run with podman the way the manifests run
//! it: the binaries start and say their version, the driver on a node without NVML says what is
//! missing, the image's user is the declared one, and every file the DaemonSet and the Deployment
//! use is in it, with the init container really installing the enforcement library into a host
//! folder; and a claim's container, started by podman from the driver's CDI spec, is held to the
//! claim's memory by that library (over the stand-in NVIDIA driver of `vgpu/standin`).
//!
//! No registry is involved: the image is the Containerfile's `prebuilt` target, which packs the
//! binaries this workspace already built (no second compile), on a Debian bookworm base made by
//! `deploy/tools/debian-base-image` (debootstrap into a tarball, imported into podman under the
//! name the Containerfile uses).
//!
//! The test skips, saying why, without podman, without the base tarball or without the built
//! binaries; with `GPUPOOL_IMAGE_TEST=required` (set by `.ci/run` once it has installed all of
//! them) a missing piece fails it instead.
//!
//! How podman runs here (root in a VM without systemd, without `CAP_SYS_RESOURCE`, with cgroup v1
//! controllers beside a cgroup2 mount), each setting found by trying:
//! - `--root`/`--runroot` under the target folder: a private image store, so nothing of the
//!   machine's own podman is touched or relied on, and the imported base stays for the next run
//!   (CI starts clean and imports it once, in seconds).
//! - `--storage-driver overlay` (the kernel's overlayfs, `GPUPOOL_PODMAN_STORAGE_DRIVER` to
//!   change): `vfs` works too but copies the whole root filesystem for every container, about
//!   30 s a run here against 1 s.
//! - `--cgroup-manager cgroupfs`: there is no systemd to ask for a scope.
//! - `--runtime runc` where runc is installed: Debian 12's crun refuses the mixed mounts with
//!   "cgroups in hybrid mode not supported, drop all controllers from cgroupv2"; runc runs.
//! - `--ulimit nofile=4096:4096 --ulimit nproc=4096:4096` on every run: podman's defaults (a
//!   higher NOFILE and NPROC than this process has) need `CAP_SYS_RESOURCE`, and the runtime
//!   fails with "setrlimit RLIMIT_NOFILE: Operation not permitted"; lowering a limit needs nothing.
//! - `podman build --isolation chroot --pull=never`: the RUN step (useradd) runs in a chroot, with
//!   no OCI runtime and none of the limits above involved (and with the host's network, the only
//!   one chroot isolation allows; nothing in the build uses it), and the base is never pulled.
//! - `podman run --network none`: nothing here needs a network, and none can be had.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use gpupool_e2e::harness::objects::Request;
use gpupool_e2e::harness::process::binary_dirs;
use gpupool_e2e::harness::{workspace_root, ClusterSpec, NodeSpec};
use serde_json::Value;

/// The user the Containerfile declares and the controller's pod runs as.
const IMAGE_USER: &str = "65532:65532";
/// The Containerfile's runtime base, which deploy/tools/debian-base-image imports.
const BASE_IMAGE: &str = "docker.io/library/debian:bookworm-slim";
/// Where the image keeps the enforcement library (`gpupool-driver install-lib`'s default source).
const IMAGE_LIBRARY: &str = "/usr/local/lib/gpupool/libgpupool_vgpu.so";
const LIBRARY: &str = "libgpupool_vgpu.so";
const BINARIES: [&str; 2] = ["gpupool-driver", "gpupool-controller"];

/// Why the image checks cannot run here; a skip, unless CI said every piece is installed.
fn skip(test: &str, why: &str) -> Option<Image> {
    if std::env::var("GPUPOOL_IMAGE_TEST").as_deref() == Ok("required") {
        panic!("{test}: {why} (GPUPOOL_IMAGE_TEST=required)");
    }
    println!("skipping {test}: {why}");
    None
}

/// The cargo target folder this test was built into (target/<profile>/deps/<test>).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.ancestors()
        .nth(3)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// The folder of the workspace's built binaries (target/<profile>), holding all of `files`.
fn built_dir(files: &[&str]) -> Option<PathBuf> {
    binary_dirs()
        .into_iter()
        .find(|dir| files.iter().all(|f| dir.join(f).is_file()))
}

/// podman with this machine's settings (module docs) and a private store under `state`.
#[derive(Clone)]
struct Podman {
    state: PathBuf,
    runtime: Option<&'static str>,
    storage_driver: String,
}

impl Podman {
    fn new(state: PathBuf) -> Self {
        let runc = Command::new("runc")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        Podman {
            state,
            runtime: runc.then_some("runc"),
            storage_driver: std::env::var("GPUPOOL_PODMAN_STORAGE_DRIVER")
                .unwrap_or_else(|_| "overlay".into()),
        }
    }

    /// podman's global options, as deploy/tools/debian-base-image takes them after `--`.
    fn global_args(&self) -> Vec<String> {
        let mut args = vec![
            "--root".to_owned(),
            self.state.join("root").display().to_string(),
            "--runroot".to_owned(),
            self.state.join("run").display().to_string(),
            "--storage-driver".to_owned(),
            self.storage_driver.clone(),
            "--cgroup-manager".to_owned(),
            "cgroupfs".to_owned(),
        ];
        if let Some(runtime) = self.runtime {
            args.extend(["--runtime".to_owned(), runtime.to_owned()]);
        }
        args
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("podman");
        cmd.args(self.global_args()).args(args);
        cmd
    }

    fn output(&self, args: &[&str]) -> Output {
        self.command(args)
            .output()
            .unwrap_or_else(|e| panic!("podman {args:?}: {e}"))
    }

    /// `podman run --rm` with the settings every run needs here, then `args`.
    fn run(&self, args: &[&str]) -> Output {
        let mut all = vec![
            "run",
            "--rm",
            "--network",
            "none",
            "--ulimit",
            "nofile=4096:4096",
            "--ulimit",
            "nproc=4096:4096",
        ];
        all.extend_from_slice(args);
        self.output(&all)
    }
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn succeeded(out: Output, what: &str) -> String {
    assert!(out.status.success(), "{what}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The built image: its name (the manifests' own image reference) and how to run it.
#[derive(Clone)]
struct Image {
    name: String,
    podman: Podman,
    /// The folder the binaries and the library were taken from.
    built: PathBuf,
}

/// The image, built once for all tests of this file; `None` where a piece is missing (`test` says
/// which).
fn image(test: &str) -> Option<Image> {
    static BUILT: OnceLock<Result<Image, String>> = OnceLock::new();
    if !Command::new("podman")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return skip(
            test,
            "podman is not installed (Debian: apt-get install podman runc), and the image is \
             built and run with it",
        );
    }
    let tarball = std::env::var_os("GPUPOOL_BASE_ROOTFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("image/debian-bookworm-minbase.tar"));
    if !tarball.is_file() {
        return skip(
            test,
            &format!(
                "no base image tarball at {} (make it with deploy/tools/debian-base-image: \
                 debootstrap, a few minutes, as root)",
                tarball.display()
            ),
        );
    }
    let mut files: Vec<&str> = BINARIES.to_vec();
    files.push(LIBRARY);
    let Some(built) = built_dir(&files) else {
        return skip(
            test,
            "the binaries and the library are not all built next to this test (cargo build \
             -p gpupool-driver -p gpupool-controller -p gpupool-vgpu; cargo test builds the \
             binaries but not the library's .so, .ci/run builds it)",
        );
    };
    match BUILT.get_or_init(|| build(&tarball, &built)) {
        Ok(image) => Some(image.clone()),
        Err(e) => panic!("{e}"),
    }
}

/// The base imported from `tarball` (again when the tarball changed), then the Containerfile's
/// prebuilt target from the binaries in `built`.
fn build(tarball: &Path, built: &Path) -> Result<Image, String> {
    let state = target_dir().join("image-test");
    let podman = Podman::new(state.join("podman"));

    let stamp = {
        let meta = std::fs::metadata(tarball).map_err(|e| e.to_string())?;
        format!("{} {:?}", meta.len(), meta.modified().ok())
    };
    let stamp_file = state.join("base-imported-from");
    let imported = podman
        .output(&["image", "exists", BASE_IMAGE])
        .status
        .success()
        && std::fs::read_to_string(&stamp_file).ok().as_deref() == Some(stamp.as_str());
    if !imported {
        let out = Command::new(workspace_root().join("deploy/tools/debian-base-image"))
            .arg("--import")
            .arg("--")
            .args(podman.global_args())
            .env("GPUPOOL_BASE_ROOTFS", tarball)
            .output()
            .map_err(|e| format!("deploy/tools/debian-base-image: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "deploy/tools/debian-base-image --import: {}",
                text(&out)
            ));
        }
        std::fs::write(&stamp_file, &stamp).map_err(|e| e.to_string())?;
    }

    // The build context holds only the three files (hard links: no copy of large debug builds),
    // in the folder the Containerfile's BIN_DIR names.
    let context = state.join("context");
    let _ = std::fs::remove_dir_all(&context);
    let bin = context.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| e.to_string())?;
    for file in BINARIES.iter().chain([&LIBRARY]) {
        let (from, to) = (built.join(file), bin.join(file));
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(|e| format!("{}: {e}", from.display()))?;
        }
    }
    let name = manifest_image();
    let containerfile = workspace_root().join("deploy/Containerfile");
    let out = podman.output(&[
        "build",
        "--isolation",
        "chroot",
        "--pull=never",
        "--target",
        "prebuilt",
        "--build-arg",
        "BIN_DIR=bin",
        "-f",
        containerfile.to_str().expect("utf-8 path"),
        "-t",
        &name,
        context.to_str().expect("utf-8 path"),
    ]);
    if !out.status.success() {
        return Err(format!("podman build --target prebuilt: {}", text(&out)));
    }
    // The image of the previous run, untagged by this one, would keep its copy of the binaries
    // (hundreds of MiB in a debug build) in the store for good.
    let _ = podman.output(&["image", "prune", "--force"]);
    Ok(Image {
        name,
        podman,
        built: built.to_path_buf(),
    })
}

/// Every YAML document of the kustomize base, as JSON.
fn base_objects() -> Vec<Value> {
    // The base is plain YAML files; the manifests test checks it renders with kustomize.
    let dir = workspace_root().join("deploy/base");
    let mut objects = Vec::new();
    for name in [
        "driver-daemonset.yaml",
        "controller-deployment.yaml",
        "webhook.yaml",
    ] {
        let text = std::fs::read_to_string(dir.join(name)).expect("read the base");
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value: Value = serde::Deserialize::deserialize(doc).expect("YAML");
            if !value.is_null() {
                objects.push(value);
            }
        }
    }
    objects
}

/// The image the manifests run (the same reference in every container of the base).
fn manifest_image() -> String {
    let images: std::collections::BTreeSet<String> = base_objects()
        .iter()
        .flat_map(|o| pod_containers(o).into_iter().cloned())
        .filter_map(|c| c["image"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(images.len(), 1, "one image for every container: {images:?}");
    images.into_iter().next().expect("an image")
}

fn pod_containers(workload: &Value) -> Vec<&Value> {
    let pod = &workload["spec"]["template"]["spec"];
    ["initContainers", "containers"]
        .iter()
        .filter_map(|list| pod[list].as_array())
        .flatten()
        .collect()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn daemonset_container(name: &str) -> Value {
    base_objects()
        .iter()
        .find(|o| o["kind"] == "DaemonSet")
        .and_then(|ds| pod_containers(ds).into_iter().find(|c| c["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("the base's DaemonSet has no container {name}"))
}

fn workspace_version() -> String {
    let manifest =
        std::fs::read_to_string(workspace_root().join("Cargo.toml")).expect("Cargo.toml");
    let in_package = manifest
        .split("[workspace.package]")
        .nth(1)
        .expect("[workspace.package]");
    in_package
        .lines()
        .find_map(|l| l.trim().strip_prefix("version = \""))
        .and_then(|rest| rest.split('"').next())
        .expect("workspace version")
        .to_owned()
}

#[test]
fn both_binaries_start_in_the_image_and_print_their_version() {
    let Some(image) = image("both_binaries_start_in_the_image_and_print_their_version") else {
        return;
    };
    let version = workspace_version();
    // The image's tag (the manifests' reference) is the version the binaries report.
    assert!(
        image.name.ends_with(&format!(":{version}")),
        "{} is tagged with {version}",
        image.name
    );
    for binary in BINARIES {
        let out = image.podman.run(&[&image.name, binary, "--version"]);
        let printed = succeeded(out, &format!("{binary} --version in the image"));
        assert_eq!(printed, format!("{binary} {version}"));
    }
    // The library loads in the image: every library it needs is there.
    let ldd = succeeded(
        image.podman.run(&[&image.name, "ldd", IMAGE_LIBRARY]),
        "ldd of the library",
    );
    assert!(!ldd.contains("not found"), "{ldd}");
}

#[test]
fn the_driver_without_nvml_or_fake_gpus_says_what_is_missing() {
    let Some(image) = image("the_driver_without_nvml_or_fake_gpus_says_what_is_missing") else {
        return;
    };
    // The DaemonSet's own command and flags, on a node with neither an NVIDIA driver nor
    // --fake-gpus (the base, which is for real GPU nodes, has no --fake-gpus).
    let driver = daemonset_container("driver");
    let mut args: Vec<String> = vec!["--user".into(), "0".into()];
    args.extend(["-e".into(), "NODE_NAME=node-1".into()]);
    args.extend([
        "-e".into(),
        "POD_UID=1f0e6c1a-0000-4000-8000-000000000001".into(),
    ]);
    args.push(image.name.clone());
    args.extend(strings(&driver["command"]));
    args.extend(strings(&driver["args"]));
    assert!(
        !args.iter().any(|a| a.starts_with("--fake-gpus")),
        "{args:?}"
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = image.podman.run(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the driver ran without GPUs: {}",
        text(&out)
    );
    // As README says: NVML's library named, and the way out (--fake-gpus) offered.
    for part in ["libnvidia-ml.so.1", "could not be loaded", "--fake-gpus"] {
        assert!(
            stderr.contains(part),
            "the error says {part:?}: {}",
            text(&out)
        );
    }
    assert!(
        !stderr.contains("panicked"),
        "a clear message, not a panic: {stderr}"
    );
}

#[test]
fn the_image_runs_as_its_declared_user_and_cannot_change_its_files() {
    let Some(image) = image("the_image_runs_as_its_declared_user_and_cannot_change_its_files")
    else {
        return;
    };
    let user = succeeded(
        image.podman.output(&[
            "image",
            "inspect",
            "--format",
            "{{.Config.User}}",
            &image.name,
        ]),
        "podman image inspect",
    );
    assert_eq!(user, IMAGE_USER);
    let ids = succeeded(
        image
            .podman
            .run(&[&image.name, "sh", "-c", "echo $(id -u):$(id -g)"]),
        "id in the image",
    );
    assert_eq!(ids, IMAGE_USER, "the default user of a container");
    // Programs and library belong to root, readable and runnable by all, writable by none other.
    let mut paths: Vec<String> = BINARIES
        .iter()
        .map(|b| format!("/usr/local/bin/{b}"))
        .collect();
    paths.push(IMAGE_LIBRARY.to_owned());
    for path in &paths {
        let owner_mode = succeeded(
            image
                .podman
                .run(&[&image.name, "stat", "-c", "%u:%g %a", path]),
            &format!("stat {path}"),
        );
        assert_eq!(owner_mode, "0:0 755", "{path}");
    }
    // The default command is the controller's, which without a cluster says what it lacks.
    let out = image.podman.run(&[&image.name]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("KUBERNETES_SERVICE_HOST")
            || String::from_utf8_lossy(&out.stderr).contains("kubeconfig"),
        "the controller names what it misses: {}",
        text(&out)
    );
}

#[test]
fn the_image_holds_what_the_manifests_run_and_installs_the_library() {
    let Some(image) = image("the_image_holds_what_the_manifests_run_and_installs_the_library")
    else {
        return;
    };
    // Every command of every container resolves through the image's own PATH.
    for workload in base_objects() {
        for c in pod_containers(&workload) {
            let command = strings(&c["command"]);
            let program = command.first().expect("a command");
            let path = succeeded(
                image
                    .podman
                    .run(&[&image.name, "sh", "-c", &format!("command -v {program}")]),
                &format!("{program} of container {} on PATH", c["name"]),
            );
            assert_eq!(path, format!("/usr/local/bin/{program}"));
        }
    }

    // The init container as the DaemonSet runs it: its user, a read-only root, no capabilities,
    // no privilege escalation, the host folder mounted at its path; the library lands there whole.
    let init = daemonset_container("install-lib");
    let security = &init["securityContext"];
    let mount = init["volumeMounts"][0]["mountPath"]
        .as_str()
        .expect("the init container's mount");
    let host = tempfile::tempdir().expect("tempdir");
    let volume = format!("{}:{mount}", host.path().display());
    let user = security["runAsUser"]
        .as_i64()
        .expect("runAsUser")
        .to_string();
    let mut args: Vec<String> = vec!["--user".into(), user, "-v".into(), volume];
    if security["readOnlyRootFilesystem"] == true {
        args.push("--read-only".into());
    }
    for cap in strings(&security["capabilities"]["drop"]) {
        args.extend(["--cap-drop".into(), cap]);
    }
    if security["allowPrivilegeEscalation"] == false {
        args.extend(["--security-opt".into(), "no-new-privileges".into()]);
    }
    args.push(image.name.clone());
    args.extend(strings(&init["command"]));
    args.extend(strings(&init["args"]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    succeeded(image.podman.run(&args), "the install-lib init container");

    let installed = host.path().join(LIBRARY);
    let expected = std::fs::read(image.built.join(LIBRARY)).expect("the built library");
    let got = std::fs::read(&installed)
        .unwrap_or_else(|e| panic!("{} after install-lib: {e}", installed.display()));
    assert!(got == expected, "the installed library is the built one");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&installed)
        .expect("stat")
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(mode, 0o755, "{:o}", mode);
    let left: Vec<String> = std::fs::read_dir(host.path())
        .expect("read the host folder")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, [LIBRARY], "no temporary file left beside it");

    // Run again over the installed copy (a restarted pod): still one whole library.
    succeeded(image.podman.run(&args), "install-lib a second time");
    assert!(std::fs::read(&installed).expect("read") == expected);
}

/// A workspace cdylib built into `profile` (`target/<profile>`: `lib<stem>.so` there or, with a
/// hash, in `deps/`): the newest, as `cargo test` may leave an older one beside it.
fn built_cdylib(profile: &Path, stem: &str) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = vec![profile.join(format!("lib{stem}.so"))];
    if let Ok(entries) = std::fs::read_dir(profile.join("deps")) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("lib{stem}")) && name.ends_with(".so") {
                found.push(entry.path());
            }
        }
    }
    found
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(time, _)| *time)
        .map(|(_, p)| p)
}

/// Removes a file when dropped (a CDI spec put in the runtime's folder for one test).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A fractional claim's container, started by podman from the CDI spec the driver wrote, with the
/// library the image's init container installed on the node: every process in it is held to the
/// claim's memory, with no `LD_PRELOAD` of its own. The only stand-in is the NVIDIA driver (the
/// test's `libcuda.so.1` and `libnvidia-ml.so.1`, mounted where the NVIDIA container toolkit would
/// mount the real ones, and its simulated card carrying the fake GPU's UUID); the driver, the kubelet
/// emulator's prepare, the CDI spec, podman's CDI injection, `/etc/ld.so.preload` and the library
/// are the real ones. Podman 4.3 reads CDI specs only from `/etc/cdi` and `/var/run/cdi`, so the
/// claim's spec is copied to `/var/run/cdi` for the test (a node's runtime reads the driver's
/// `--cdi-root` there) and removed after it.
#[tokio::test(flavor = "multi_thread")]
async fn a_claims_container_from_the_cdi_spec_is_held_to_its_memory() {
    const TEST: &str = "a_claims_container_from_the_cdi_spec_is_held_to_its_memory";
    let Some(image) = image(TEST) else {
        return;
    };
    let probe = image.built.join("cuda-probe");
    let (Some(cuda), Some(nvml)) = (
        built_cdylib(&image.built, "gpupool_standin_cuda"),
        built_cdylib(&image.built, "gpupool_standin_nvml"),
    ) else {
        skip(
            TEST,
            "the stand-in CUDA driver and NVML are not built (cargo test --workspace builds them)",
        );
        return;
    };
    if !probe.is_file() {
        skip(
            TEST,
            "cuda-probe is not built (cargo test --workspace builds it)",
        );
        return;
    }
    let cdi_dir = Path::new("/var/run/cdi");
    if std::fs::create_dir_all(cdi_dir).is_err() {
        skip(
            TEST,
            "podman's CDI folder /var/run/cdi is not writable here",
        );
        return;
    }

    let cluster = common::start(ClusterSpec {
        nodes: vec![NodeSpec::new("node-1", "a100-40gb:1")],
        ..ClusterSpec::new()
    })
    .await;
    let node = cluster.node_at(0);

    // The DaemonSet's init container, from the image, installs the library into the node's folder
    // that the driver mounts into limited containers (`--gpupool-lib-dir`).
    let lib_dir = node
        .dirs
        .state
        .parent()
        .expect("the node's base folder")
        .join("libs/gpupool");
    std::fs::create_dir_all(&lib_dir).expect("the node's library folder");
    let init = daemonset_container("install-lib");
    let mount = init["volumeMounts"][0]["mountPath"]
        .as_str()
        .expect("the init container's mount");
    let user = init["securityContext"]["runAsUser"]
        .as_i64()
        .expect("runAsUser")
        .to_string();
    let mut args = vec![
        "--user".to_owned(),
        user,
        "-v".to_owned(),
        format!("{}:{mount}", lib_dir.display()),
        image.name.clone(),
    ];
    args.extend(strings(&init["command"]));
    args.extend(strings(&init["args"]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    succeeded(image.podman.run(&args), "the install-lib init container");

    common::apply_device_class(&cluster).await;
    let uuid = common::device_uuid(&cluster, "node-1", "gpu-0", 1).await;
    common::apply_claim_and_pod(
        &cluster,
        "default",
        "limited",
        &[Request::new("gpu").on(&uuid).memory("1Gi").cores("50")],
    )
    .await;
    common::wait_pod_running(&cluster, "default", "limited").await;
    let claim = common::claim(&cluster, "default", "limited").await;
    let claim_uid = claim.metadata.uid.clone().expect("a claim uid");
    let prepared = common::prepared(node, &claim_uid).await;
    let device_ids = prepared.cdi_device_ids();
    assert_eq!(device_ids.len(), 1, "{device_ids:?}");

    let spec_path = node.cdi_spec_path(&claim_uid);
    let in_runtime = cdi_dir.join(spec_path.file_name().expect("a file name"));
    std::fs::copy(&spec_path, &in_runtime).expect("the spec into /var/run/cdi");
    let _remove = RemoveOnDrop(in_runtime);

    // What the NVIDIA container toolkit would mount: the driver's libraries (here the stand-ins).
    let nvidia = tempfile::tempdir().expect("tempdir");
    std::fs::copy(&cuda, nvidia.path().join("libcuda.so.1")).expect("copy");
    std::fs::copy(&nvml, nvidia.path().join("libnvidia-ml.so.1")).expect("copy");
    std::fs::copy(&probe, nvidia.path().join("cuda-probe")).expect("copy");
    let container = |device: Option<&str>, probe_args: &[&str]| {
        let mut args: Vec<String> = vec![
            "-v".into(),
            format!("{}:/usr/local/nvidia:ro", nvidia.path().display()),
            "-e".into(),
            "LD_LIBRARY_PATH=/usr/local/nvidia".into(),
            "-e".into(),
            "GPUPOOL_STANDIN_DEVICES=1x40g:108".into(),
            "-e".into(),
            format!("GPUPOOL_STANDIN_UUIDS={uuid}"),
            "-e".into(),
            "GPUPOOL_STANDIN_STATE=/tmp/standin.state".into(),
        ];
        if let Some(device) = device {
            args.extend(["--device".into(), device.to_owned()]);
        }
        args.extend([BASE_IMAGE.to_owned(), "/usr/local/nvidia/cuda-probe".into()]);
        args.extend(probe_args.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = image.podman.run(&args);
        let stdout = succeeded(out, &format!("cuda-probe {probe_args:?} with {device:?}"));
        stdout
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect::<Vec<Value>>()
    };
    let line = |lines: &[Value], op: &str| -> Value {
        lines
            .iter()
            .find(|l| l["op"] == op)
            .cloned()
            .unwrap_or_else(|| panic!("no {op} line in {lines:?}"))
    };
    const GIB: u64 = 1 << 30;

    // Without the claim's device the container sees the whole card: the limit is the claim's.
    let bare = container(None, &["views"]);
    assert_eq!(
        line(&bare, "views")["cu_mem_get_info"]["total"].as_u64(),
        Some(40 * GIB)
    );

    let device = device_ids[0].as_str();
    let views = line(&container(Some(device), &["views"]), "views");
    assert_eq!(views["uuid"].as_str(), Some(uuid.as_str()));
    assert_eq!(
        views["cu_mem_get_info"]["total"].as_u64(),
        Some(GIB),
        "{views}"
    );
    assert_eq!(
        views["cu_device_total_mem"]["bytes"].as_u64(),
        Some(GIB),
        "{views}"
    );
    assert_eq!(views["nvml"]["v1"]["total"].as_u64(), Some(GIB), "{views}");

    // Half the claim fits; the claim and a byte more does not, whatever the card has free.
    let half = line(
        &container(
            Some(device),
            &["alloc", "--path", "cuMemAlloc", "--size", "512m"],
        ),
        "alloc",
    );
    assert_eq!(half["error"], "CUDA_SUCCESS", "{half}");
    let over = line(
        &container(
            Some(device),
            &[
                "alloc",
                "--path",
                "cuMemAlloc",
                "--size",
                &(GIB + 1).to_string(),
            ],
        ),
        "alloc",
    );
    assert_eq!(over["error"], "CUDA_ERROR_OUT_OF_MEMORY", "{over}");
}

/// An MPS share's container, started by podman from the driver's CDI spec: its processes reach
/// the card's MPS control daemon (the stand-in `nvidia-cuda-mps-control` the driver started) through
/// the mounted pipe folder, see the daemon's `/dev/shm` as theirs and get the claim's share, also
/// as another user (the daemon runs with `-M`); without the claim's device a container runs
/// without MPS. What is a stand-in: the daemon and the CUDA client attaching (the stand-in's
/// `--standin-cuda-client`, which fails where a real client would: no shared memory, another pipe
/// path); the driver, the kubelet emulator's prepare, the CDI spec and podman are the real ones.
#[tokio::test(flavor = "multi_thread")]
async fn an_mps_shares_container_reaches_its_cards_daemon() {
    const TEST: &str = "an_mps_shares_container_reaches_its_cards_daemon";
    let Some(image) = image(TEST) else {
        return;
    };
    let standin = image.built.join("nvidia-cuda-mps-control");
    if !standin.is_file() {
        skip(
            TEST,
            "the stand-in nvidia-cuda-mps-control is not built (cargo test --workspace builds it)",
        );
        return;
    }
    let cdi_dir = Path::new("/var/run/cdi");
    if std::fs::create_dir_all(cdi_dir).is_err() {
        skip(
            TEST,
            "podman's CDI folder /var/run/cdi is not writable here",
        );
        return;
    }
    let mut node = NodeSpec::new("node-1", "a100-40gb:1");
    node.extra_driver_args = vec!["--mps-control".into(), standin.display().to_string()];
    let cluster = common::start(ClusterSpec {
        nodes: vec![node],
        ..ClusterSpec::new()
    })
    .await;
    let node = cluster.node_at(0);
    let _daemons = KillDaemonsOnDrop(node.dirs.run.clone());
    // A node's run folder lies under /var/run (0755): clients of every user pass through it.
    {
        use std::os::unix::fs::PermissionsExt;
        for dir in node.dirs.run.ancestors().skip(1).take(3) {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        }
    }
    common::apply_device_class(&cluster).await;
    let uuid = common::device_uuid(&cluster, "node-1", "gpu-0", 1).await;
    let mut request = Request::new("gpu").on(&uuid).memory("1Gi").cores("30");
    request.gpu_config = Some(serde_json::json!({"compute": "Mps"}));
    common::apply_claim_and_pod(&cluster, "default", "mps-share", &[request]).await;
    common::wait_pod_running(&cluster, "default", "mps-share").await;
    let claim = common::claim(&cluster, "default", "mps-share").await;
    let claim_uid = claim.metadata.uid.clone().expect("a claim uid");
    let device_ids = common::prepared(node, &claim_uid).await.cdi_device_ids();
    let spec_path = node.cdi_spec_path(&claim_uid);
    let in_runtime = cdi_dir.join(spec_path.file_name().expect("a file name"));
    std::fs::copy(&spec_path, &in_runtime).expect("the spec into /var/run/cdi");
    let _remove = RemoveOnDrop(in_runtime);

    let tools = tempfile::tempdir().expect("tempdir");
    std::fs::copy(&standin, tools.path().join("nvidia-cuda-mps-control")).expect("copy");
    let client = |device: Option<&str>, user: &str| {
        let mut args: Vec<String> = vec![
            "--user".into(),
            user.into(),
            "-v".into(),
            format!("{}:/usr/local/mps:ro", tools.path().display()),
        ];
        if let Some(device) = device {
            args.extend(["--device".into(), device.to_owned()]);
        }
        args.extend([
            BASE_IMAGE.to_owned(),
            "/usr/local/mps/nvidia-cuda-mps-control".into(),
            "--standin-cuda-client".into(),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = image.podman.run(&args);
        let stdout = succeeded(out, &format!("the MPS client as {user} with {device:?}"));
        serde_json::from_str::<Value>(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    };
    let device = device_ids[0].as_str();
    for user in ["0:0", "65534:65534"] {
        let attached = client(Some(device), user);
        assert_eq!(attached["mps"], true, "{user}: {attached}");
        assert_eq!(
            attached["activeThreadPercentage"], 30.0,
            "{user}: {attached}"
        );
    }
    let bare = client(None, "0:0");
    assert_eq!(bare["mps"], false, "{bare}");

    // The pod goes, the kubelet unprepares its claim, and the card's daemon stops with it.
    let daemons =
        || gpupool_driver::mps::daemon::daemons_under(&node.dirs.run, "nvidia-cuda-mps-control");
    assert_eq!(daemons().len(), 1, "one daemon for the card");
    common::delete_pod(&cluster, "default", "mps-share").await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !daemons().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon outlived the last claim of its card: {:?}",
            daemons()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Kills the MPS daemons and servers of a node's run folder when dropped: a failed test leaves
/// none running.
struct KillDaemonsOnDrop(PathBuf);

impl Drop for KillDaemonsOnDrop {
    fn drop(&mut self) {
        use gpupool_driver::mps::daemon::{processes_under, SERVER_NAME};
        for name in ["nvidia-cuda-mps-control", SERVER_NAME] {
            for pid in processes_under(&self.0, name) {
                // SAFETY: kill(2) of a stand-in process this test's driver started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}
