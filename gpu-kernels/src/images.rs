//! Which kernel image a GPU loads for a source file, in this order:
//!
//! 1. a cubin embedded at build time (`build.rs`, when NVRTC was there) for the GPU's
//!    architecture or an older one of the same major version (a cubin for sm_80 runs on
//!    every 8.x GPU);
//! 2. a cubin NVRTC compiles now for the exact architecture, cached on disk
//!    ([`nvrtc::kernel_image`](crate::nvrtc::kernel_image)); without NVRTC, one an earlier
//!    run cached;
//! 3. the embedded PTX, which the driver compiles for the GPU (and caches itself).
//!
//! So a GPU of an embedded architecture never needs NVRTC, and any other GPU from compute
//! 8.0 on needs it only for the best code.

use std::borrow::Cow;
use std::fmt;

pub use crate::nvrtc_flags::EMBEDDED_ARCHS;
use crate::{KernelError, Result};

include!(concat!(env!("OUT_DIR"), "/embedded_kernels.rs"));

/// Where a module image came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageOrigin {
    /// A cubin built ahead for this architecture (e.g. `sm_90`).
    EmbeddedCubin(&'static str),
    /// A cubin NVRTC compiled at run time (or an earlier run cached).
    Compiled,
    /// PTX built ahead for this virtual architecture (e.g. `compute_80`), compiled by the
    /// driver.
    EmbeddedPtx(&'static str),
}

impl fmt::Display for ImageOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EmbeddedCubin(arch) => write!(f, "embedded {arch} cubin"),
            Self::Compiled => write!(f, "cubin compiled by NVRTC at run time"),
            Self::EmbeddedPtx(arch) => write!(f, "embedded {arch} PTX, compiled by the driver"),
        }
    }
}

/// A kernel file's image for one GPU.
pub struct ModuleImage {
    /// The cubin, or NUL-terminated PTX.
    pub bytes: Cow<'static, [u8]>,
    /// Where it came from.
    pub origin: ImageOrigin,
}

/// The (source file, architecture) pairs built into this binary.
pub fn embedded() -> impl Iterator<Item = (&'static str, &'static str)> {
    EMBEDDED.iter().map(|(file, arch, _)| (*file, *arch))
}

/// The NVRTC that built the embedded images (`NVRTC 12.9`), or `None` when this binary
/// was built without NVRTC and embeds nothing.
pub fn embedded_with() -> Option<&'static str> {
    (!EMBEDDED_WITH.is_empty()).then_some(EMBEDDED_WITH)
}

/// The architecture number of `sm_90` or `compute_80`: (9, 0), (8, 0).
fn arch_version(arch: &str) -> Option<(i32, i32)> {
    let digits = arch.rsplit('_').next()?;
    let (major, minor) = digits.split_at(digits.len().checked_sub(1)?);
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The best embedded image of `file` of one kind (`sm_` or `compute_`) that a GPU of compute
/// capability `cc` runs: cubins of its major version up to its minor, PTX of any version up
/// to its own.
fn best_embedded(
    file: &str,
    cc: (i32, i32),
    prefix: &str,
) -> Option<(&'static str, &'static [u8])> {
    EMBEDDED
        .iter()
        .filter(|(f, arch, _)| *f == file && arch.starts_with(prefix))
        .filter_map(|&(_, arch, bytes)| Some((arch_version(arch)?, arch, bytes)))
        .filter(|&(v, _, _)| {
            if prefix == "sm_" {
                v.0 == cc.0 && v.1 <= cc.1
            } else {
                v <= cc
            }
        })
        .max_by_key(|&(v, _, _)| v)
        .map(|(_, arch, bytes)| (arch, bytes))
}

/// The image of `file` for a GPU of compute capability `cc` (see the module's order).
pub fn module_image(file: &str, cc: (i32, i32)) -> Result<ModuleImage> {
    if let Some((arch, bytes)) = best_embedded(file, cc, "sm_") {
        return Ok(ModuleImage {
            bytes: Cow::Borrowed(bytes),
            origin: ImageOrigin::EmbeddedCubin(arch),
        });
    }
    let compiled = crate::nvrtc::kernel_image(file, cc);
    if let Ok(cubin) = compiled {
        return Ok(ModuleImage {
            bytes: Cow::Owned(cubin),
            origin: ImageOrigin::Compiled,
        });
    }
    if let Some((arch, bytes)) = best_embedded(file, cc, "compute_") {
        return Ok(ModuleImage {
            bytes: Cow::Borrowed(bytes),
            origin: ImageOrigin::EmbeddedPtx(arch),
        });
    }
    let built = match embedded_with() {
        Some(nvrtc) => format!(
            "this build embeds {} (by {nvrtc})",
            EMBEDDED_ARCHS.join(", ")
        ),
        None => "this build embeds no kernels (NVRTC was not found when it was built)".into(),
    };
    let why = compiled.err().map(|e| e.to_string()).unwrap_or_default();
    Err(KernelError::Driver(format!(
        "no kernel image of {file} for compute {}.{}: {built}, and none could be compiled now \
         ({why})",
        cc.0, cc.1
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_are_read_from_their_names() {
        assert_eq!(arch_version("sm_90"), Some((9, 0)));
        assert_eq!(arch_version("compute_80"), Some((8, 0)));
        assert_eq!(arch_version("sm_120"), Some((12, 0)));
        assert_eq!(arch_version("sm_"), None);
    }
}
