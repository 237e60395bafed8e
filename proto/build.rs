//! Compiles the kubelet contracts with protox (a protobuf compiler in Rust), so no system `protoc` is needed.

const PROTOS: [&str; 5] = [
    "proto/pluginregistration.proto",
    "proto/dra_v1.proto",
    "proto/dra_v1beta1.proto",
    "proto/dra_health_v1alpha1.proto",
    "proto/dra_health_v1.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
