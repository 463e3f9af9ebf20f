//! Row hashes of one or several columns (`cuda/hash.cu`), and the same function on the host.
//!
//! A row's hash combines its columns' hashes left to right; a NULL value hashes to a fixed
//! constant, so NULL keys meet each other (grouping) and callers that need SQL's "NULL
//! equals nothing" (joins) leave NULL rows out themselves. Floats hash -0.0 as 0.0 and every
//! NaN alike.

use arrow::array::{Array, AsArray};
use arrow::datatypes::{
    DataType, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type,
    UInt16Type, UInt32Type, UInt64Type,
};

use super::{BLOCK, check_rows};
use crate::column::{DeviceColumn, Layout};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// The hash of a NULL value.
pub const NULL_HASH: u64 = 0x5bd1_e995_5bd1_e995;

/// MurmurHash3's 64-bit finaliser.
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// Folds one more column's hash into a row's hash.
pub fn hash_combine(seed: u64, h: u64) -> u64 {
    seed ^ h
        .wrapping_add(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(seed << 6)
        .wrapping_add(seed >> 2)
}

/// The hash of a fixed-width value given as its little-endian bits (zero-extended).
pub fn hash_fixed(bits: u64, width: u64) -> u64 {
    fmix64(bits ^ (width << 56))
}

/// The hash of a 16-byte value (decimal128).
pub fn hash_fixed16(lo: u64, hi: u64) -> u64 {
    hash_combine(fmix64(lo ^ (16 << 56)), fmix64(hi))
}

/// The hash of a string's bytes.
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut fnv: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        fnv ^= b as u64;
        fnv = fnv.wrapping_mul(0x0100_0000_01b3);
    }
    fmix64(fnv ^ bytes.len() as u64)
}

fn canonical_f32(v: f32) -> u32 {
    if v == 0.0 {
        0
    } else if v.is_nan() {
        0x7fc0_0000
    } else {
        v.to_bits()
    }
}

fn canonical_f64(v: f64) -> u64 {
    if v == 0.0 {
        0
    } else if v.is_nan() {
        0x7ff8_0000_0000_0000
    } else {
        v.to_bits()
    }
}

/// The row hashes of host arrays, computed as the kernels do (the reference for tests, and
/// the CPU's way to agree with device-built tables).
pub fn hash_rows_host(columns: &[&dyn Array]) -> Result<Vec<u64>> {
    let n = columns.first().map_or(0, |c| c.len());
    let mut hashes = vec![0u64; n];
    for (k, column) in columns.iter().enumerate() {
        // Taken once per column: the integer-backed types (dates, times, …) read its buffer.
        let data = column.to_data();
        for (i, slot) in hashes.iter_mut().enumerate() {
            let h = if column.is_null(i) {
                NULL_HASH
            } else {
                value_hash(*column, &data, i)?
            };
            *slot = if k == 0 { h } else { hash_combine(*slot, h) };
        }
    }
    Ok(hashes)
}

fn value_hash(column: &dyn Array, data: &arrow::array::ArrayData, i: usize) -> Result<u64> {
    use DataType::*;
    Ok(match column.data_type() {
        Int8 => hash_fixed(column.as_primitive::<Int8Type>().value(i) as u8 as u64, 1),
        UInt8 => hash_fixed(column.as_primitive::<UInt8Type>().value(i) as u64, 1),
        Int16 => hash_fixed(column.as_primitive::<Int16Type>().value(i) as u16 as u64, 2),
        UInt16 => hash_fixed(column.as_primitive::<UInt16Type>().value(i) as u64, 2),
        Int32 => hash_fixed(column.as_primitive::<Int32Type>().value(i) as u32 as u64, 4),
        UInt32 => hash_fixed(column.as_primitive::<UInt32Type>().value(i) as u64, 4),
        Int64 => hash_fixed(column.as_primitive::<Int64Type>().value(i) as u64, 8),
        UInt64 => hash_fixed(column.as_primitive::<UInt64Type>().value(i), 8),
        Float32 => hash_fixed(
            canonical_f32(column.as_primitive::<Float32Type>().value(i)) as u64,
            4,
        ),
        Float64 => hash_fixed(
            canonical_f64(column.as_primitive::<Float64Type>().value(i)),
            8,
        ),
        Decimal128(p, _) => {
            let v = column
                .as_primitive::<arrow::datatypes::Decimal128Type>()
                .value(i);
            if *p <= crate::column::NARROW_DECIMAL_PRECISION {
                // 64 bits on the device, hashed as such.
                hash_fixed(v as i64 as u64, 8)
            } else {
                hash_fixed16(v as u64, ((v as u128) >> 64) as u64)
            }
        }
        Utf8 => hash_bytes(column.as_string::<i32>().value(i).as_bytes()),
        LargeUtf8 => hash_bytes(column.as_string::<i64>().value(i).as_bytes()),
        Binary => hash_bytes(column.as_binary::<i32>().value(i)),
        LargeBinary => hash_bytes(column.as_binary::<i64>().value(i)),
        other => {
            // Dates, times, timestamps and durations hash by their integer value.
            match crate::column::layout_of(other) {
                Some(Layout::Fixed(4)) => {
                    let v: &[u32] = data.buffers()[0].typed_data();
                    hash_fixed(v[data.offset() + i] as u64, 4)
                }
                Some(Layout::Fixed(8)) => {
                    let v: &[u64] = data.buffers()[0].typed_data();
                    hash_fixed(v[data.offset() + i], 8)
                }
                _ => return Err(KernelError::Unsupported(format!("hashing {other} values"))),
            }
        }
    })
}

/// Columns one `hash_many` launch hashes (`HASH_MANY` in `cuda/hash.cu`), and its kinds of
/// column besides the fixed widths (1, 2, 4, 8, 16).
const HASH_MANY: usize = 6;
const KIND_F32: u64 = 0x20;
const KIND_F64: u64 = 0x21;
const KIND_STR32: u64 = 0x40;
const KIND_STR64: u64 = 0x41;
const KIND_DICT: u64 = 0x50;

/// The row hashes of `columns` (all on one device, of equal length), one u64 per row:
/// up to six columns a launch.
pub fn hash_columns(device: &Device, columns: &[&DeviceColumn]) -> Result<DeviceBuffer> {
    let n = columns.first().map_or(0, |c| c.len());
    check_rows(n)?;
    if columns.iter().any(|c| c.len() != n) {
        return Err(KernelError::Unsupported(
            "hashing columns of different lengths".into(),
        ));
    }
    let hashes = device.alloc(n * 8)?;
    let cfg = LaunchConfig::for_items(device, n as u64, BLOCK);
    for (group, these) in columns.chunks(HASH_MANY).enumerate() {
        // hash_many(n, hashes, combine, kinds, (a, b, validity) × HASH_MANY)
        let mut kinds = 0u64;
        let mut args = vec![
            Arg::U64(n as u64),
            Arg::buf(&hashes),
            Arg::U32(u32::from(group > 0)),
        ];
        let mut per_column = Vec::with_capacity(3 * HASH_MANY);
        let mut reached: Vec<&DeviceBuffer> = Vec::new();
        for (k, column) in these.iter().enumerate() {
            if column.device() != device {
                return Err(KernelError::Unsupported(format!(
                    "hashing a column of {} on {device}",
                    column.device()
                )));
            }
            let kind = match (column.layout(), column.data_type()) {
                (_, DataType::Float32) => KIND_F32,
                (_, DataType::Float64) => KIND_F64,
                (Layout::Fixed(width @ (1 | 2 | 4 | 8 | 16)), _) => width as u64,
                (Layout::Var(4), _) => KIND_STR32,
                (Layout::Var(8), _) => KIND_STR64,
                (Layout::Dict, _) => KIND_DICT,
                (_, other) => {
                    return Err(KernelError::Unsupported(format!("hashing {other} columns")));
                }
            };
            kinds |= kind << (8 * k);
            let (a, b) = match (column.offsets(), column.dictionary()) {
                (Some(offsets), _) => (Arg::buf(offsets), Arg::buf(column.values())),
                (None, Some(dictionary)) => {
                    reached.extend(dictionary.buffers());
                    (Arg::buf(column.values()), Arg::buf(dictionary.header()))
                }
                (None, None) => (Arg::buf(column.values()), Arg::Ptr(0)),
            };
            per_column.extend([a, b, Arg::opt(column.validity())]);
        }
        per_column.resize(3 * HASH_MANY, Arg::Ptr(0));
        args.push(Arg::U64(kinds));
        args.extend(per_column);
        // SAFETY: every column has n rows (checked) in the layout its kind reads (values
        // of the kind's width, or offsets + bytes, or codes below the length of the
        // dictionary whose header is passed: `DeviceColumn::with_dictionary`'s contract),
        // each validity bitmap (or null) n bits; slots past the columns are null and their
        // kind 0; `hashes` holds n u64 (read first when combining).
        unsafe { device.launch_reaching(Kernel::hash_many, cfg, &args, &reached)? };
    }
    Ok(hashes)
}
