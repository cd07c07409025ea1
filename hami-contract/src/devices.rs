//! The container device list (contract §3.2): `UUID,Type,Usedmem,Usedcores:` per device,
//! `;` after every container, init containers first.
//!
//! Written by the extender into `hami.io/vgpu-devices-allocated` and
//! `hami.io/vgpu-devices-to-allocate`; read by the device plugin, the extender's usage
//! accounting and HAMi's own components.

use std::fmt;

/// Separates device entries inside one container entry (HAMi: `OneContainerMultiDeviceSplitSymbol`).
pub const DEVICE_SEPARATOR: char = ':';
/// Terminates every container entry (HAMi: `OnePodMultiContainerSplitSymbol`).
pub const CONTAINER_SEPARATOR: char = ';';

/// One GPU (or GPU share) given to one container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerDevice {
    /// Physical GPU UUID, e.g. `GPU-8dcd427f-483b-b48f-d7e5-75fb19a52b76`.
    pub uuid: String,
    /// Vendor key (`NVIDIA`), not the model name.
    pub vendor: String,
    /// Device memory in MiB, already resolved from a percentage where one was asked.
    pub usedmem: u32,
    /// Percent of the GPU's SMs.
    pub usedcores: u32,
}

/// The devices of one container, in annotation order (their index is the `_<i>` of
/// `CUDA_DEVICE_MEMORY_LIMIT_<i>`).
pub type ContainerDevices = Vec<ContainerDevice>;

/// One entry per container, init containers first, in spec order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodDevices(pub Vec<ContainerDevices>);

/// Why a container device list could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceListError {
    /// HAMi's "pod annotation format error": fewer than four fields.
    #[error(
        "pod annotation format error: device entry {entry:?} has {fields} comma-separated fields, need at least 4 (UUID,Type,Usedmem,Usedcores)"
    )]
    TooFewFields {
        /// The device entry as written.
        entry: String,
        /// How many comma-separated fields it has.
        fields: usize,
    },
    /// A memory or cores field that is not an integer in 0..=i32::MAX.
    #[error(
        "pod annotation format error: {field} {value:?} in device entry {entry:?} is not a non-negative 32-bit integer"
    )]
    BadNumber {
        /// The device entry as written.
        entry: String,
        /// `Usedmem` or `Usedcores`.
        field: &'static str,
        /// The field's text.
        value: String,
    },
}

impl ContainerDevice {
    /// An NVIDIA entry: `uuid` with `usedmem` MiB and `usedcores` percent.
    pub fn nvidia(uuid: impl Into<String>, usedmem: u32, usedcores: u32) -> Self {
        ContainerDevice {
            uuid: uuid.into(),
            vendor: crate::NVIDIA_VENDOR.to_owned(),
            usedmem,
            usedcores,
        }
    }

    fn decode(piece: &str) -> Result<Self, DeviceListError> {
        let fields: Vec<&str> = piece.split(',').collect();
        if fields.len() < 4 {
            return Err(DeviceListError::TooFewFields {
                entry: piece.to_owned(),
                fields: fields.len(),
            });
        }
        let number = |field: &'static str, value: &str| {
            value
                .parse::<u32>()
                .ok()
                .filter(|v| i32::try_from(*v).is_ok())
                .ok_or_else(|| DeviceListError::BadNumber {
                    entry: piece.to_owned(),
                    field,
                    value: value.to_owned(),
                })
        };
        Ok(ContainerDevice {
            uuid: fields[0].to_owned(),
            vendor: fields[1].to_owned(),
            usedmem: number("Usedmem", fields[2])?,
            usedcores: number("Usedcores", fields[3])?,
        })
    }
}

impl fmt::Display for ContainerDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{},{},{},{}{DEVICE_SEPARATOR}",
            self.uuid, self.vendor, self.usedmem, self.usedcores
        )
    }
}

impl PodDevices {
    /// Decodes HAMi's format. Pieces without a `,` are skipped (as HAMi does); a piece with
    /// fewer than four fields is an error; extra fields are ignored.
    ///
    /// Unlike HAMi, the terminating `;` does not produce an extra empty container entry, so
    /// `decode(encode(x)) == x` and a well-formed value re-encodes byte for byte. A value
    /// without the final `;` (not produced by HAMi) decodes the same as with it.
    pub fn decode(value: &str) -> Result<Self, DeviceListError> {
        if value.is_empty() {
            return Ok(PodDevices::default());
        }
        let body = value.strip_suffix(CONTAINER_SEPARATOR).unwrap_or(value);
        let mut containers = Vec::new();
        for container in body.split(CONTAINER_SEPARATOR) {
            let mut devices = Vec::new();
            for piece in container.split(DEVICE_SEPARATOR) {
                if piece.contains(',') {
                    devices.push(ContainerDevice::decode(piece)?);
                }
            }
            containers.push(devices);
        }
        Ok(PodDevices(containers))
    }

    /// Encodes in HAMi's format: every device followed by `:`, every container by `;`.
    pub fn encode(&self) -> String {
        self.to_string()
    }

    /// True when no container has any device left: the "nothing pending" state of
    /// `hami.io/vgpu-devices-to-allocate` (e.g. `;;` after HAMi's plugin served a pod).
    pub fn is_all_empty(&self) -> bool {
        self.0.iter().all(Vec::is_empty)
    }

    /// Entries of one vendor only, container structure kept.
    pub fn of_vendor(&self, vendor: &str) -> PodDevices {
        PodDevices(
            self.0
                .iter()
                .map(|c| c.iter().filter(|d| d.vendor == vendor).cloned().collect())
                .collect(),
        )
    }
}

impl fmt::Display for PodDevices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for container in &self.0 {
            for device in container {
                device.fmt(f)?;
            }
            write!(f, "{CONTAINER_SEPARATOR}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The contract's examples are pinned in tests/golden.rs (s3_2_device_list_table).

    #[test]
    fn served_value_is_all_empty() {
        assert!(PodDevices::decode(";;").unwrap().is_all_empty());
        assert!(PodDevices::decode(";").unwrap().is_all_empty());
        assert!(PodDevices::decode("").unwrap().is_all_empty());
    }

    #[test]
    fn short_entry_is_an_error_naming_the_entry() {
        let err = PodDevices::decode("GPU-aaa,NVIDIA,3000:;").unwrap_err();
        assert!(err.to_string().contains("GPU-aaa,NVIDIA,3000"), "{err}");
        let err = PodDevices::decode("GPU-aaa,NVIDIA,-1,3:;").unwrap_err();
        assert!(err.to_string().contains("Usedmem"), "{err}");
    }
}
