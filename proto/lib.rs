//! Generated gRPC types for the kubelet APIs Tessera speaks (see `README.md` for provenance):
//!
//! * [`deviceplugin::v1beta1`]: the device plugin API (`Registration` served by the kubelet,
//!   `DevicePlugin` served by plugins);
//! * [`podresources::v1`]: the pod-resources API (`PodResourcesLister`, served by the kubelet);
//! * [`dra::v1`]: the DRA plugin API (`DRAPlugin`, served by DRA drivers);
//! * [`pluginregistration`]: the kubelet's plugin registration API (`Registration`, served by
//!   plugins in the kubelet's plugin registry directory).
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

/// DRA plugin API.
pub mod dra {
    /// Package `k8s.io.kubelet.pkg.apis.dra.v1`.
    #[allow(
        missing_docs,
        clippy::all,
        clippy::pedantic,
        missing_debug_implementations
    )]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");

        /// The name a plugin lists in `PluginInfo.supported_versions` for this API: the
        /// kubelet's "<package's last part>.<service>", not the gRPC service name.
        pub const SERVICE_VERSION: &str = "v1.DRAPlugin";
    }
}

/// Plugin registration API (upstream package `pluginregistration`, directory `v1`).
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations
)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");

    /// `PluginInfo.type` of a DRA driver.
    pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
    /// The kubelet's plugin registry directory (it watches it for registration sockets).
    pub const REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
    /// The kubelet's directory for plugins' own sockets.
    pub const PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
}

/// gRPC over the kubelet's unix sockets, for both sides (plugins dial the kubelet's
/// `Registration` and pod-resources sockets; the kubelet, or a test harness acting as one, dials
/// the plugin's).
pub mod transport {
    use std::path::Path;
    use std::time::Duration;

    use hyper_util::rt::TokioIo;
    use tokio::net::UnixStream;
    use tonic::transport::{Channel, Endpoint, Uri};

    /// A channel to the gRPC server on the unix socket at `path`.
    pub async fn unix_channel(
        path: &Path,
        connect_timeout: Duration,
    ) -> Result<Channel, tonic::transport::Error> {
        let path = path.to_path_buf();
        // tonic wants a URI; the connector ignores it and dials the socket.
        Endpoint::from_static("http://[::]:50051")
            .connect_timeout(connect_timeout)
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { UnixStream::connect(path).await.map(TokioIo::new) }
            }))
            .await
    }
}

#[cfg(test)]
mod tests {
    /// The kubelet calls the services by these full names; a package typo would compile and
    /// never be called.
    #[test]
    fn dra_and_registration_service_names_are_the_kubelets() {
        use tonic::server::NamedService;
        type Dra = super::dra::v1::dra_plugin_server::DraPluginServer<()>;
        type Reg = super::pluginregistration::registration_server::RegistrationServer<()>;
        assert_eq!(
            <Dra as NamedService>::NAME,
            "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
        );
        assert_eq!(
            <Reg as NamedService>::NAME,
            "pluginregistration.Registration"
        );
    }
}
