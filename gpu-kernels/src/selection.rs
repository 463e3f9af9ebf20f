//! Device selection: the value of `FULMEN_DEVICES` and of the `fulmen.devices` setting.
//!
//! ```text
//! auto          every CUDA device on this machine (none if there is no driver)
//! none          no device: everything runs on the CPU
//! cuda:0,2      the listed CUDA devices
//! emulated:N    N emulated devices (the CUDA execution model on the host CPU)
//! emulated:N/S  N emulated devices of the set named S: sets of other names (and plain
//!               emulated:N) are other devices, so a test's counters are its own
//! ```

use std::fmt;
use std::str::FromStr;

use crate::KernelError;

/// Which devices a session may use.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum DeviceSelection {
    /// Every CUDA device found on this machine.
    #[default]
    Auto,
    /// No device at all.
    None,
    /// The CUDA devices with these ordinals, in this order, without repeats.
    Cuda(Vec<usize>),
    /// This many emulated devices.
    Emulated(usize),
    /// This many emulated devices of a set of their own, by name: no other selection
    /// reaches them (tests use this to keep their device counters apart).
    EmulatedSet(usize, String),
}

/// The most emulated devices one session may ask for: each runs kernels on host threads,
/// so more than this only slows tests down.
pub const MAX_EMULATED_DEVICES: usize = 64;

impl FromStr for DeviceSelection {
    type Err = KernelError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: &str| KernelError::InvalidSelection {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let text = input.trim().to_ascii_lowercase();
        match text.as_str() {
            "auto" | "" => return Ok(Self::Auto),
            "none" | "cpu" => return Ok(Self::None),
            _ => {}
        }
        let Some((kind, list)) = text.split_once(':') else {
            return Err(invalid("unknown device kind"));
        };
        match kind.trim() {
            "cuda" | "gpu" => {
                let mut ordinals = Vec::new();
                for part in list.split(',') {
                    let ordinal: usize = part.trim().parse().map_err(|_| {
                        invalid(&format!("'{}' is not a device number", part.trim()))
                    })?;
                    if ordinals.contains(&ordinal) {
                        return Err(invalid(&format!("device {ordinal} is listed twice")));
                    }
                    ordinals.push(ordinal);
                }
                Ok(Self::Cuda(ordinals))
            }
            "emulated" | "emu" => {
                let (list, set) = match list.split_once('/') {
                    Some((count, set)) => (count, Some(set.trim())),
                    None => (list, None),
                };
                if let Some(set) = set
                    && (set.is_empty()
                        || !set
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
                {
                    return Err(invalid(
                        "a set name after '/' is letters, digits, '-' and '_'",
                    ));
                }
                let count: usize = list.trim().parse().map_err(|_| {
                    invalid("the number of emulated devices must be a whole number")
                })?;
                if count == 0 || count > MAX_EMULATED_DEVICES {
                    return Err(invalid(&format!(
                        "the number of emulated devices must be between 1 and {MAX_EMULATED_DEVICES}"
                    )));
                }
                Ok(match set {
                    Some(set) => Self::EmulatedSet(count, set.to_string()),
                    None => Self::Emulated(count),
                })
            }
            other => Err(invalid(&format!("unknown device kind '{other}'"))),
        }
    }
}

impl fmt::Display for DeviceSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::None => f.write_str("none"),
            Self::Cuda(ordinals) => {
                f.write_str("cuda:")?;
                for (i, o) in ordinals.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{o}")?;
                }
                Ok(())
            }
            Self::Emulated(n) => write!(f, "emulated:{n}"),
            Self::EmulatedSet(n, set) => write!(f, "emulated:{n}/{set}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form_and_round_trips() {
        for (text, expected) in [
            ("auto", DeviceSelection::Auto),
            ("none", DeviceSelection::None),
            ("cuda:0,1", DeviceSelection::Cuda(vec![0, 1])),
            (" CUDA: 3 ", DeviceSelection::Cuda(vec![3])),
            ("emulated:4", DeviceSelection::Emulated(4)),
            (
                "emulated:2/q-1_b",
                DeviceSelection::EmulatedSet(2, "q-1_b".into()),
            ),
        ] {
            let parsed: DeviceSelection = text.parse().unwrap();
            assert_eq!(parsed, expected, "{text}");
            let again: DeviceSelection = parsed.to_string().parse().unwrap();
            assert_eq!(again, parsed);
        }
    }

    #[test]
    fn rejects_bad_input_with_a_reason() {
        for (text, needle) in [
            ("gpu", "unknown device kind"),
            ("cuda:x", "'x' is not a device number"),
            ("cuda:1,1", "listed twice"),
            ("emulated:0", "between 1 and"),
            ("emulated:many", "whole number"),
            ("tpu:1", "unknown device kind 'tpu'"),
            ("emulated:1/", "a set name"),
            ("emulated:1/a b", "a set name"),
            ("emulated:0/x", "between 1 and"),
        ] {
            let err = text.parse::<DeviceSelection>().unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
            assert!(err.contains(text), "the message names the input: {err}");
        }
    }
}
