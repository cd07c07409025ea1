//! Generates the tonic/prost code for the kubelet APIs with a vendored `protoc`, so building
//! needs no system protobuf compiler.

/// Every vendored proto (README.md says where each comes from).
const PROTOS: &[&str] = &[
    "api.proto",
    "podresources/v1/api.proto",
    "dra/v1/api.proto",
    "pluginregistration/v1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // `std::env::set_var("PROTOC", ..)` is unsafe in edition 2024 (and the workspace forbids
    // unsafe code), so the path goes through prost-build's config instead.
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, PROTOS, &["."])?;
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
