//! Command line of `gpupool-driver`; every `run` flag can also come from an environment variable so
//! the DaemonSet can set it from the downward API.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use gpupool_api::names::DRIVER_NAME;

/// In the plugin folder, which every instance on the node mounts.
pub const SERIALIZE_LOCK_FILE: &str = "serialize.lock";

#[derive(Debug, Parser)]
#[command(
    name = "gpupool-driver",
    version,
    about = "gpupool node agent: GPU discovery, ResourceSlices, kubelet DRA plugin"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node agent: publish this node's GPUs and serve the kubelet.
    Run(Box<RunArgs>),
    /// Print this node's inventory and the ResourceSlices it would publish, as YAML (no API server).
    Inspect(InspectArgs),
    /// Tell the running driver (same --run-dir) that a GPU raised an XID, was lost, or was reset
    /// (`clear`), as NVML would: to rehearse on fake GPUs, or to lift a taint after a reset.
    InjectXid(InjectXidArgs),
    /// Copy gpupool's enforcement library onto the node (the DaemonSet's init container), where
    /// `run --gpupool-lib-dir` finds it and limited containers get it from.
    InstallLib(InstallLibArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct InstallLibArgs {
    /// The library to install (the image carries it here).
    #[arg(long, default_value = crate::install::IMAGE_LIB_PATH)]
    pub from: PathBuf,
    /// The host folder, mounted into the init container at the same path.
    #[arg(long, env = "GPUPOOL_LIB_DIR", default_value = "/usr/local/gpupool")]
    pub to: PathBuf,
}

#[derive(Debug, Clone, clap::Args)]
pub struct InjectXidArgs {
    /// The `--run-dir` of the driver to tell.
    #[arg(long, env = "RUN_DIR", default_value = "/var/run/gpupool")]
    pub run_dir: PathBuf,
    /// Device name as published, e.g. gpu-0.
    pub device: String,
    /// An XID number (e.g. 79), `lost`, or `clear` once the card has been reset.
    pub xid: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Name of this node (the pool name of its slices).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Kubeconfig file; the in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Folder the kubelet watches for registration sockets.
    #[arg(
        long,
        env = "REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    pub registry_dir: PathBuf,
    /// Folder of this plugin's DRA socket (dra.sock).
    #[arg(
        long,
        env = "PLUGIN_DIR",
        default_value = "/var/lib/kubelet/plugins/gpupool.dev"
    )]
    pub plugin_dir: PathBuf,
    /// Folder of the CDI specs the container runtime reads.
    #[arg(long, env = "CDI_ROOT", default_value = "/var/run/cdi")]
    pub cdi_root: PathBuf,
    /// Folder of the checkpoint.
    #[arg(
        long,
        env = "STATE_DIR",
        default_value = "/var/lib/kubelet/plugins/gpupool.dev"
    )]
    pub state_dir: PathBuf,
    /// Folder of per-boot state: HAMi-core's per-claim cache folders, which containers map and
    /// no reboot needs. On a tmpfs (like /var/run) each prepare creates its folder without a
    /// disk write.
    #[arg(long, env = "RUN_DIR", default_value = "/var/run/gpupool")]
    pub run_dir: PathBuf,
    /// Fake GPUs instead of NVML, e.g. a100-40gb:2,v100-32gb:1; an entry may add `+mig` (MIG mode on
    /// at start), `+nvswitch` (its cards on one NVSwitch fabric) or `+nvlink-pairs` (bridged pairs),
    /// e.g. h100-80gb:8+nvswitch.
    #[arg(long, env = "FAKE_GPUS")]
    pub fake_gpus: Option<String>,
    /// Host folder holding HAMi-core's libvgpu.so.
    #[arg(long, env = "VGPU_LIB_DIR", default_value = "/usr/local/vgpu")]
    pub vgpu_lib_dir: PathBuf,
    /// Host folder holding gpupool's own libgpupool_vgpu.so (`install-lib` puts it there).
    #[arg(long, env = "GPUPOOL_LIB_DIR", default_value = "/usr/local/gpupool")]
    pub gpupool_lib_dir: PathBuf,
    /// Which library enforces a claim whose GpuConfig names none: `Auto` is gpupool's where
    /// installed, else HAMi-core where installed, else none (the claim's status says so).
    #[arg(
        long,
        env = "DEFAULT_ENFORCEMENT",
        value_enum,
        default_value = "Auto",
        ignore_case = true
    )]
    pub default_enforcement: DefaultEnforcementArg,
    /// Where real GPUs' driver libraries come from: `nvidia-cdi` returns the node's NVIDIA CDI device
    /// (`nvidia.com/gpu=<uuid or index>`) beside gpupool's own; `none` leaves them to the image.
    #[arg(
        long,
        env = "DRIVER_LIBRARIES",
        value_enum,
        default_value = "nvidia-cdi"
    )]
    pub driver_libraries: DriverLibrariesArg,
    /// Folders searched for the NVIDIA CDI spec, in order.
    #[arg(
        long,
        env = "NVIDIA_CDI_DIRS",
        value_delimiter = ',',
        default_value = "/etc/cdi,/var/run/cdi"
    )]
    pub nvidia_cdi_dirs: Vec<PathBuf>,
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Address of the HTTP health endpoint (GET /healthz), e.g. 127.0.0.1:51515; off when absent.
    #[arg(long, env = "HEALTHZ_ADDR")]
    pub healthz_addr: Option<SocketAddr>,
    /// Address of the Prometheus endpoint (GET /metrics): `host:port`, `:port` for every address,
    /// or empty to turn it off.
    #[arg(
        long,
        env = "METRICS_ADDR",
        default_value = ":9464",
        value_parser = crate::metrics::parse_listen_addr
    )]
    pub metrics_addr: crate::metrics::ListenAddr,
    /// UID of this driver's pod (the DaemonSet sets it from the downward API). With it the sockets
    /// carry the UID, so that during a rolling update the new pod registers beside the old one and
    /// the kubelet moves to it without a gap; both then take turns on the node's claims.
    #[arg(long, env = "POD_UID", value_parser = parse_pod_uid)]
    pub pod_uid: Option<String>,
    /// NVIDIA's `nvidia-cuda-mps-control` (a path, or a name looked up on PATH), run for claims with
    /// `compute: Mps`: one control daemon per card that holds MPS shares. Needed only then.
    #[arg(long, env = "MPS_CONTROL", default_value = crate::mps::CONTROL_BINARY)]
    pub mps_control: PathBuf,
    /// Start the MPS daemons with `-M`: one server serves the clients of every user (pods running
    /// as different users share the card at once). Without it a pod of another user than the
    /// card's current clients waits until they have all exited.
    #[arg(long, env = "MPS_MULTI_USER", default_value_t = true, action = clap::ArgAction::Set)]
    pub mps_multi_user: bool,
    /// XIDs that taint a GPU `gpupool.dev/xid=<xid>:NoSchedule` until it is cleared.
    #[arg(long, env = "XID_FATAL", value_delimiter = ',', default_values_t = crate::health::DEFAULT_XID_FATAL)]
    pub xid_fatal: Vec<u32>,
    /// XIDs caused by applications, not the card: logged and counted, never tainted.
    #[arg(long, env = "XID_IGNORE", value_delimiter = ',', default_values_t = crate::health::DEFAULT_XID_IGNORE)]
    pub xid_ignore: Vec<u32>,
}

/// The pod UID becomes part of two file names: only letters, digits and inner dashes (a UUID,
/// a DNS-1123 label) can never name another folder or another plugin's socket.
fn parse_pod_uid(value: &str) -> Result<String, String> {
    const MAX: usize = 63;
    let alphanumeric = |c: char| c.is_ascii_alphanumeric();
    if value.is_empty() {
        return Err(
            "empty; expected the pod's UID, e.g. from the downward API (metadata.uid)".into(),
        );
    }
    if value.len() > MAX {
        return Err(format!(
            "{} characters; a pod UID has at most {MAX}",
            value.len()
        ));
    }
    if let Some(bad) = value.chars().find(|c| !alphanumeric(*c) && *c != '-') {
        return Err(format!(
            "{bad:?} is not allowed; a pod UID has only letters, digits and dashes"
        ));
    }
    if !value.starts_with(alphanumeric) || !value.ends_with(alphanumeric) {
        return Err("a pod UID starts and ends with a letter or a digit".into());
    }
    Ok(value.to_string())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "PascalCase")]
pub enum DefaultEnforcementArg {
    Auto,
    Gpupool,
    HamiCore,
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DriverLibrariesArg {
    NvidiaCdi,
    None,
}

impl RunArgs {
    pub fn default_enforcement(&self) -> crate::prepare::DefaultEnforcement {
        use crate::prepare::DefaultEnforcement::{Auto, Fixed};
        use gpupool_api::config::Enforcement;
        match self.default_enforcement {
            DefaultEnforcementArg::Auto => Auto,
            DefaultEnforcementArg::Gpupool => Fixed(Enforcement::Gpupool),
            DefaultEnforcementArg::HamiCore => Fixed(Enforcement::HamiCore),
            DefaultEnforcementArg::None => Fixed(Enforcement::None),
        }
    }

    pub fn mps(&self) -> crate::mps::MpsSettings {
        crate::mps::MpsSettings {
            control: self.mps_control.clone(),
            multi_user: self.mps_multi_user,
        }
    }

    pub fn driver_libraries(&self) -> crate::prepare::DriverLibraries {
        match self.driver_libraries {
            DriverLibrariesArg::NvidiaCdi => crate::prepare::DriverLibraries::NvidiaCdi {
                spec_dirs: self.nvidia_cdi_dirs.clone(),
            },
            DriverLibrariesArg::None => crate::prepare::DriverLibraries::None,
        }
    }

    /// `<registry-dir>/gpupool.dev-reg.sock`, or `gpupool.dev-<podUID>-reg.sock` with a pod UID.
    pub fn registration_socket(&self) -> PathBuf {
        match &self.pod_uid {
            Some(uid) => self
                .registry_dir
                .join(format!("{DRIVER_NAME}-{uid}-reg.sock")),
            None => self.registry_dir.join(format!("{DRIVER_NAME}-reg.sock")),
        }
    }

    /// `<plugin-dir>/dra.sock`, or `dra-<podUID>.sock` with a pod UID.
    pub fn dra_socket(&self) -> PathBuf {
        match &self.pod_uid {
            Some(uid) => self.plugin_dir.join(format!("dra-{uid}.sock")),
            None => self.plugin_dir.join("dra.sock"),
        }
    }

    /// The lock that instances sharing this node's folders (a rolling update with surge) hold
    /// for each prepare and unprepare; none without a pod UID, where only one instance runs.
    pub fn serialize_lock(&self) -> Option<PathBuf> {
        self.pod_uid
            .as_ref()
            .map(|_| self.plugin_dir.join(SERIALIZE_LOCK_FILE))
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct InspectArgs {
    /// Fake GPUs instead of NVML, e.g. a100-40gb:2,v100-32gb:1; an entry may add `+mig` (MIG mode on
    /// at start), `+nvswitch` (its cards on one NVSwitch fabric) or `+nvlink-pairs` (bridged pairs),
    /// e.g. h100-80gb:8+nvswitch.
    #[arg(long, env = "FAKE_GPUS")]
    pub fake_gpus: Option<String>,
    /// Node name for the slices; the host name when absent.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_defaults_follow_the_kubelet_layout() {
        let cli = Cli::try_parse_from(["gpupool-driver", "run", "--node-name", "n1"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        assert_eq!(
            args.registration_socket(),
            PathBuf::from("/var/lib/kubelet/plugins_registry/gpupool.dev-reg.sock")
        );
        assert_eq!(
            args.dra_socket(),
            PathBuf::from("/var/lib/kubelet/plugins/gpupool.dev/dra.sock")
        );
        assert_eq!(args.cdi_root, PathBuf::from("/var/run/cdi"));
        assert_eq!(args.run_dir, PathBuf::from("/var/run/gpupool"));
        assert_eq!(args.vgpu_lib_dir, PathBuf::from("/usr/local/vgpu"));
        assert_eq!(args.gpupool_lib_dir, PathBuf::from("/usr/local/gpupool"));
        assert_eq!(
            args.default_enforcement(),
            crate::prepare::DefaultEnforcement::Auto
        );
        assert_eq!(args.log_format, LogFormat::Text);
        assert_eq!(
            args.metrics_addr.0,
            Some(SocketAddr::from(([0, 0, 0, 0], 9464)))
        );
    }

    #[test]
    fn run_takes_every_flag() {
        let cli = Cli::try_parse_from([
            "gpupool-driver",
            "run",
            "--node-name",
            "n1",
            "--kubeconfig",
            "/k",
            "--registry-dir",
            "/r",
            "--plugin-dir",
            "/p",
            "--cdi-root",
            "/c",
            "--state-dir",
            "/s",
            "--run-dir",
            "/u",
            "--fake-gpus",
            "t4:1",
            "--vgpu-lib-dir",
            "/v",
            "--log-format",
            "json",
            "--healthz-addr",
            "127.0.0.1:51515",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        assert_eq!(
            args.registration_socket(),
            PathBuf::from("/r/gpupool.dev-reg.sock")
        );
        assert_eq!(args.dra_socket(), PathBuf::from("/p/dra.sock"));
        assert_eq!(args.fake_gpus.as_deref(), Some("t4:1"));
        assert_eq!(args.run_dir, PathBuf::from("/u"));
        assert_eq!(args.log_format, LogFormat::Json);
        assert_eq!(args.healthz_addr.unwrap().port(), 51515);
        assert_eq!(args.metrics_addr.0, Some("127.0.0.1:0".parse().unwrap()));
    }

    #[test]
    fn default_enforcement_names_a_library_or_none() {
        use crate::prepare::DefaultEnforcement::Fixed;
        use gpupool_api::config::Enforcement;
        for (value, want) in [
            ("HamiCore", Fixed(Enforcement::HamiCore)),
            ("gpupool", Fixed(Enforcement::Gpupool)),
            ("None", Fixed(Enforcement::None)),
        ] {
            let args = run_args(&["--default-enforcement", value]).unwrap();
            assert_eq!(args.default_enforcement(), want, "{value}");
        }
        let e = run_args(&["--default-enforcement", "hami"]).unwrap_err();
        assert!(e.to_string().contains("Gpupool"), "{e}");
    }

    #[test]
    fn mps_runs_nvidia_cuda_mps_control_from_path_in_multi_user_mode_unless_told() {
        let args = run_args(&[]).unwrap();
        assert_eq!(args.mps(), crate::mps::MpsSettings::default());
        assert_eq!(args.mps().control, PathBuf::from("nvidia-cuda-mps-control"));
        assert!(args.mps().multi_user);
        let args = run_args(&[
            "--mps-control",
            "/usr/local/nvidia/bin/nvidia-cuda-mps-control",
            "--mps-multi-user",
            "false",
        ])
        .unwrap();
        assert_eq!(
            args.mps().control,
            PathBuf::from("/usr/local/nvidia/bin/nvidia-cuda-mps-control")
        );
        assert!(!args.mps().multi_user);
    }

    #[test]
    fn an_empty_metrics_address_turns_the_endpoint_off() {
        assert_eq!(run_args(&["--metrics-addr="]).unwrap().metrics_addr.0, None);
    }

    fn run_args(extra: &[&str]) -> Result<RunArgs, clap::Error> {
        let mut argv = vec!["gpupool-driver", "run", "--node-name", "n1"];
        argv.extend_from_slice(extra);
        let Command::Run(args) = Cli::try_parse_from(argv)?.command else {
            panic!("not run")
        };
        Ok(*args)
    }

    #[test]
    fn without_a_pod_uid_the_sockets_keep_their_names_and_nothing_is_serialized() {
        let args = run_args(&["--registry-dir", "/r", "--plugin-dir", "/p"]).unwrap();
        assert_eq!(args.pod_uid, None);
        assert_eq!(
            args.registration_socket(),
            PathBuf::from("/r/gpupool.dev-reg.sock")
        );
        assert_eq!(args.dra_socket(), PathBuf::from("/p/dra.sock"));
        assert_eq!(args.serialize_lock(), None);
    }

    #[test]
    fn a_pod_uid_names_both_sockets_and_the_shared_lock() {
        let uid = "0b7c4a49-6f1e-4a52-9d0e-6d1f3f7a5b10";
        let args = run_args(&[
            "--registry-dir",
            "/r",
            "--plugin-dir",
            "/p",
            "--pod-uid",
            uid,
        ])
        .unwrap();
        assert_eq!(
            args.registration_socket(),
            PathBuf::from(format!("/r/gpupool.dev-{uid}-reg.sock"))
        );
        assert_eq!(
            args.dra_socket(),
            PathBuf::from(format!("/p/dra-{uid}.sock"))
        );
        assert_eq!(
            args.serialize_lock(),
            Some(PathBuf::from("/p/serialize.lock"))
        );
    }

    #[test]
    fn a_pod_uid_that_could_leave_its_folder_is_refused_naming_the_flag() {
        for bad in ["", "../x", "a/b", "-a", "a-", "a.b", "a b", &"a".repeat(64)] {
            let arg = format!("--pod-uid={bad}");
            let err = run_args(&[&arg]).expect_err(bad).to_string();
            assert!(err.contains("--pod-uid"), "{bad:?}: {err}");
        }
        assert_eq!(
            run_args(&["--pod-uid", "Pod-1"])
                .unwrap()
                .pod_uid
                .as_deref(),
            Some("Pod-1")
        );
    }

    #[test]
    fn xid_lists_default_to_the_card_faults_and_take_comma_lists() {
        let args = run_args(&[]).unwrap();
        assert!(args.xid_fatal.contains(&79) && args.xid_fatal.contains(&48));
        assert!(args.xid_ignore.contains(&13) && !args.xid_ignore.contains(&79));
        let args = run_args(&["--xid-fatal", "79,31", "--xid-ignore", "13"]).unwrap();
        assert_eq!((args.xid_fatal, args.xid_ignore), (vec![79, 31], vec![13]));
        assert!(run_args(&["--xid-fatal", "seventy-nine"]).is_err());
    }

    #[test]
    fn inject_xid_names_the_run_dir_the_device_and_the_xid() {
        let cli = Cli::try_parse_from([
            "gpupool-driver",
            "inject-xid",
            "--run-dir",
            "/u",
            "gpu-0",
            "79",
        ])
        .unwrap();
        let Command::InjectXid(args) = cli.command else {
            panic!("not inject-xid")
        };
        assert_eq!(
            (args.run_dir, args.device.as_str(), args.xid.as_str()),
            (PathBuf::from("/u"), "gpu-0", "79")
        );
    }
}
