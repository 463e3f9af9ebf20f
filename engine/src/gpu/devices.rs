//! The devices of this process, opened once per selection (`fulmen.devices`) and shared by
//! every session and query that names the same selection. A GPU is one device whatever
//! selection names it (`auto`, `cuda:0`, `cuda:0,1`); a memory limit
//! (`fulmen.gpu.memory_limit`) is a quota on the devices, not other devices.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use fulmen_kernels::{Device, DeviceSelection, EmulatorOptions, open_devices};

/// Handles by (selection, memory limit); the devices themselves by selection.
#[derive(Default)]
struct Opened {
    handles: HashMap<(DeviceSelection, Option<usize>), Arc<Vec<Device>>>,
    devices: HashMap<DeviceSelection, Vec<Device>>,
}

fn opened() -> &'static Mutex<Opened> {
    static OPENED: OnceLock<Mutex<Opened>> = OnceLock::new();
    OPENED.get_or_init(Default::default)
}

/// The devices `selection` names, opened on first use (an empty list for `none`, or for
/// `auto` on a machine without a GPU). The error says why a named device cannot be opened.
pub fn devices(selection: &DeviceSelection) -> Result<Arc<Vec<Device>>, String> {
    devices_with_limit(selection, None)
}

/// The devices `selection` names, each handle holding at most `limit` bytes
/// (`fulmen.gpu.memory_limit`). Sessions with the same selection and limit share one quota
/// per device; every handle of a device shares its memory, kernels and counters, and the
/// device's own budget bounds them all together.
pub fn devices_with_limit(
    selection: &DeviceSelection,
    limit: Option<usize>,
) -> Result<Arc<Vec<Device>>, String> {
    let mut opened = opened().lock().unwrap_or_else(|p| p.into_inner());
    let key = (selection.clone(), limit);
    if let Some(handles) = opened.handles.get(&key) {
        return Ok(Arc::clone(handles));
    }
    let devices = match opened.devices.get(selection) {
        Some(devices) => devices.clone(),
        None => {
            let devices = open_devices(selection, &EmulatorOptions::default(), None)
                .map_err(|e| e.to_string())?;
            opened.devices.insert(selection.clone(), devices.clone());
            devices
        }
    };
    let handles: Vec<Device> = devices
        .iter()
        .map(|d| match limit {
            Some(limit) => d.with_memory_limit(limit),
            None => d.clone(),
        })
        .collect();
    let handles = Arc::new(handles);
    opened.handles.insert(key, Arc::clone(&handles));
    Ok(handles)
}

/// How plans show a set of devices: `emulated:0`, or `emulated:0,emulated:1`.
pub fn describe(devices: &[Device]) -> String {
    devices
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_limit_is_a_quota_on_the_same_devices() {
        let selection: DeviceSelection = "emulated:1/devices-quota".parse().unwrap();
        let whole = devices(&selection).unwrap();
        let small = devices_with_limit(&selection, Some(1 << 20)).unwrap();
        let again = devices_with_limit(&selection, Some(1 << 20)).unwrap();
        assert_eq!(whole[0], small[0], "one device, whatever the limit");
        assert!(
            Arc::ptr_eq(&small, &again),
            "one quota per selection and limit"
        );
        assert_eq!(small[0].memory_budget(), 1 << 20);
        assert!(whole[0].memory_budget() > 1 << 20);
        let held = small[0].alloc(768 << 10).unwrap();
        let refused = small[0].alloc(768 << 10).unwrap_err();
        assert!(refused.to_string().contains("memory"), "{refused}");
        // The device itself, and a handle with another limit, still have room.
        let other = devices_with_limit(&selection, Some(2 << 20)).unwrap();
        let more = other[0].alloc(768 << 10).unwrap();
        assert_eq!(whole[0].device_memory_usage().0, 2 << 20);
        assert_eq!(small[0].memory_usage().0, 1 << 20);
        drop((held, more));
        assert_eq!(small[0].memory_usage().0, 0);
        assert_eq!(whole[0].device_memory_usage().0, 0);
    }
}
