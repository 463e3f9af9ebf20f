//! The devices of this process, opened once per selection (`fulmen.devices`) and shared by
//! every session and query that names the same selection.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use fulmen_kernels::{Device, DeviceSelection, EmulatorOptions, open_devices};

type Opened = HashMap<(DeviceSelection, Option<usize>), Arc<Vec<Device>>>;

fn opened() -> &'static Mutex<Opened> {
    static OPENED: OnceLock<Mutex<Opened>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The devices `selection` names, opened on first use (an empty list for `none`, or for
/// `auto` on a machine without a GPU). The error says why a named device cannot be opened.
pub fn devices(selection: &DeviceSelection) -> Result<Arc<Vec<Device>>, String> {
    devices_with_limit(selection, None)
}

/// The devices `selection` names, each holding at most `limit` bytes
/// (`fulmen.gpu.memory_limit`). Devices opened with different limits are distinct.
pub fn devices_with_limit(
    selection: &DeviceSelection,
    limit: Option<usize>,
) -> Result<Arc<Vec<Device>>, String> {
    let mut map = opened().lock().unwrap_or_else(|p| p.into_inner());
    let key = (selection.clone(), limit);
    if let Some(devices) = map.get(&key) {
        return Ok(Arc::clone(devices));
    }
    let mut emulator = EmulatorOptions::default();
    if let Some(limit) = limit {
        emulator.memory_budget = limit;
    }
    let devices = Arc::new(open_devices(selection, &emulator, limit).map_err(|e| e.to_string())?);
    map.insert(key, Arc::clone(&devices));
    Ok(devices)
}

/// How plans show a set of devices: `emulated:0`, or `emulated:0,emulated:1`.
pub fn describe(devices: &[Device]) -> String {
    devices
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
