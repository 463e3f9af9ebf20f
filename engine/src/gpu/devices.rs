//! The devices of this process, opened once per selection (`fulmen.devices`) and shared by
//! every session and query that names the same selection. A GPU is one device whatever
//! selection names it (`auto`, `cuda:0`, `cuda:0,1`); a memory limit
//! (`fulmen.gpu.memory_limit`) is a quota of one query on the devices, not other devices.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use fulmen_kernels::{Device, DeviceSelection, EmulatorOptions, open_devices};

fn opened() -> &'static Mutex<HashMap<DeviceSelection, Arc<Vec<Device>>>> {
    static OPENED: OnceLock<Mutex<HashMap<DeviceSelection, Arc<Vec<Device>>>>> = OnceLock::new();
    OPENED.get_or_init(Default::default)
}

/// The devices `selection` names, opened on first use (an empty list for `none`, or for
/// `auto` on a machine without a GPU). The error says why a named device cannot be opened.
pub fn devices(selection: &DeviceSelection) -> Result<Arc<Vec<Device>>, String> {
    let mut opened = opened().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(devices) = opened.get(selection) {
        return Ok(Arc::clone(devices));
    }
    let devices = Arc::new(
        open_devices(selection, &EmulatorOptions::default(), None).map_err(|e| e.to_string())?,
    );
    opened.insert(selection.clone(), Arc::clone(&devices));
    Ok(devices)
}

/// The devices `selection` names, as one query's handles: with a `limit`
/// (`fulmen.gpu.memory_limit`), each handle is a quota of its own of at most `limit` bytes
/// on its device, so that concurrent queries each have their working memory; the device's
/// own budget bounds them all, the cache's tables included. Every handle of a device shares
/// its memory, kernels and counters.
pub fn query_devices(
    selection: &DeviceSelection,
    limit: Option<usize>,
) -> Result<Arc<Vec<Device>>, String> {
    let devices = devices(selection)?;
    Ok(match limit {
        None => devices,
        Some(limit) => Arc::new(devices.iter().map(|d| d.with_memory_limit(limit)).collect()),
    })
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
    fn a_memory_limit_is_a_quota_of_each_query_on_the_same_devices() {
        let selection: DeviceSelection = "emulated:1/devices-quota".parse().unwrap();
        let whole = devices(&selection).unwrap();
        let one = query_devices(&selection, Some(1 << 20)).unwrap();
        let other = query_devices(&selection, Some(1 << 20)).unwrap();
        assert_eq!(whole[0], one[0], "one device, whatever the limit");
        assert!(
            Arc::ptr_eq(&whole, &devices(&selection).unwrap()),
            "opened once"
        );
        assert_eq!(one[0].memory_budget(), 1 << 20);
        assert!(whole[0].memory_budget() > 1 << 20);
        let held = one[0].alloc(768 << 10).unwrap();
        let refused = one[0].alloc(768 << 10).unwrap_err();
        assert!(refused.to_string().contains("memory"), "{refused}");
        // Another query, with a quota of its own, still has room on the same device.
        let more = other[0].alloc(768 << 10).unwrap();
        assert_eq!(whole[0].device_memory_usage().0, 2 << 20);
        assert_eq!(one[0].memory_usage().0, 1 << 20);
        drop((held, more));
        assert_eq!(one[0].memory_usage().0, 0);
        assert_eq!(whole[0].device_memory_usage().0, 0);
    }
}
