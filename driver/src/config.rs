//! Command line of `gpupool-driver`; every `run` flag can also come from an environment variable so
//! the DaemonSet can set it from the downward API.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use gpupool_api::names::DRIVER_NAME;

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
    /// Fake GPUs instead of NVML, e.g. a100-40gb:2,v100-32gb:1.
    #[arg(long, env = "FAKE_GPUS")]
    pub fake_gpus: Option<String>,
    /// Host folder holding HAMi-core's libvgpu.so.
    #[arg(long, env = "VGPU_LIB_DIR", default_value = "/usr/local/vgpu")]
    pub vgpu_lib_dir: PathBuf,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DriverLibrariesArg {
    NvidiaCdi,
    None,
}

impl RunArgs {
    pub fn driver_libraries(&self) -> crate::prepare::DriverLibraries {
        match self.driver_libraries {
            DriverLibrariesArg::NvidiaCdi => crate::prepare::DriverLibraries::NvidiaCdi {
                spec_dirs: self.nvidia_cdi_dirs.clone(),
            },
            DriverLibrariesArg::None => crate::prepare::DriverLibraries::None,
        }
    }

    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER_NAME}-reg.sock"))
    }

    pub fn dra_socket(&self) -> PathBuf {
        self.plugin_dir.join("dra.sock")
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct InspectArgs {
    /// Fake GPUs instead of NVML, e.g. a100-40gb:2,v100-32gb:1.
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
        assert_eq!(args.log_format, LogFormat::Text);
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
    }
}
