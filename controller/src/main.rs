use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// gpupool controller: manages DeviceClasses and ResourceClaimTemplates from GpuModels and ComputeProfiles.
#[derive(Parser, Debug)]
#[command(name = "gpupool-controller", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the CRD manifests generated from the types (or write them into a folder).
    Crds {
        /// Write one file per CRD into this folder instead of printing.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Crds { dir: None } => print!("{}", gpupool_controller::crds::multi_document()),
        Command::Crds { dir: Some(dir) } => {
            for (file, yaml) in gpupool_controller::crds::manifests() {
                let path = dir.join(file);
                std::fs::write(&path, yaml)
                    .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
            }
        }
    }
    Ok(())
}
