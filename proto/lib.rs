//! Generated gRPC types for the kubelet APIs Tessera speaks (see `README.md` for provenance):
//!
//! * [`deviceplugin::v1beta1`]: the device plugin API (`Registration` served by the kubelet,
//!   `DevicePlugin` served by plugins);
//! * [`podresources::v1`]: the pod-resources API (`PodResourcesLister`, served by the kubelet).
//!
//! Field names follow the protos mechanically (`ID` becomes `id`, `available_deviceIDs` becomes
//! `available_device_i_ds`); wire compatibility depends only on field numbers and types.

/// Device plugin API v1beta1.
pub mod deviceplugin {
    /// Package `v1beta1`.
    #[allow(
        missing_docs,
        clippy::all,
        clippy::pedantic,
        missing_debug_implementations
    )]
    pub mod v1beta1 {
        tonic::include_proto!("v1beta1");

        /// The API version a plugin puts in `RegisterRequest.version`.
        pub const VERSION: &str = "v1beta1";
        /// `Device.health` of a usable device.
        pub const HEALTHY: &str = "Healthy";
        /// `Device.health` of an unusable device.
        pub const UNHEALTHY: &str = "Unhealthy";
        /// The kubelet's device plugin directory.
        pub const DEVICE_PLUGIN_PATH: &str = "/var/lib/kubelet/device-plugins/";
        /// The kubelet's registration socket file name inside [`DEVICE_PLUGIN_PATH`].
        pub const KUBELET_SOCKET_NAME: &str = "kubelet.sock";
    }
}

/// Pod-resources API v1.
pub mod podresources {
    /// Package `v1`.
    #[allow(
        missing_docs,
        clippy::all,
        clippy::pedantic,
        missing_debug_implementations
    )]
    pub mod v1 {
        tonic::include_proto!("v1");

        /// The kubelet's pod-resources socket.
        pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
    }
}
