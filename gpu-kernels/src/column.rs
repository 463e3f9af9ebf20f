//! Arrow data on a device: [`DeviceColumn`] and [`DeviceBatch`] are the device-side twins
//! of `ArrayRef` and `RecordBatch`, in Arrow's layout:
//!
//! ```text
//! fixed width   values: len × width bytes          (ints, floats, dates, times,
//!                                                   timestamps, durations, decimal128)
//! boolean       values: bitmap, LSB first
//! utf8/binary   offsets: (len + 1) × i32, from 0;  values: the bytes
//! large…        offsets: (len + 1) × i64, from 0;  values: the bytes
//! dictionary    values: len × u32 codes, each below the dictionary's length; the
//!               dictionary (a `DeviceDictionary`, shared): its strings as a utf8 column
//! any           validity: bitmap, LSB first, bit 0 = row 0; absent when no row is NULL
//! ```
//! Uploads start every buffer at row 0: sliced arrays are rebased, so kernels never see an
//! Arrow offset. Utf8View, BinaryView and dictionaries are converted on upload (to Utf8 /
//! Binary, or their large variants past 2 GiB, and to the dictionary's value type).
//!
//! Dictionary-encoded strings are made only by the cache, which encodes a low-cardinality
//! string column of a table once for all its chunks ([`DeviceColumn::with_dictionary`]).
//! Programs read them as strings (a load of the dictionary's string at the row's code);
//! gathers, concatenations of chunks of one dictionary and downloads move only the codes;
//! as keys (GROUP BY, joins) they hash and compare by the strings the codes stand for, so
//! they meet the same strings held plainly or in another dictionary.

use std::sync::Arc;

use arrow::array::{Array, ArrayData, ArrayRef, RecordBatch, make_array};
use arrow::buffer::{BooleanBuffer, MutableBuffer, NullBuffer};
use arrow::compute::cast;
use arrow::datatypes::{DataType, SchemaRef};

use crate::device::Device;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// Decimals of at most this precision live on the device as 64-bit integers: every such
/// value (|v| < 10^18 < 2^63) fits, and they move over PCIe and sit in device memory in half
/// the bytes of Arrow's 128. Uploads narrow them in the copy into pinned staging, downloads
/// widen them back; kernels read them as 64-bit values (and compute in 128 bits).
pub const NARROW_DECIMAL_PRECISION: u8 = 18;

/// Whether values of `data_type` are decimals held in 64 bits on the device.
pub fn is_narrow_decimal(data_type: &DataType) -> bool {
    matches!(data_type, DataType::Decimal128(p, _) if *p <= NARROW_DECIMAL_PRECISION)
}

/// The longest dictionary string whose decoding sizes its bytes by it (every row that
/// long at most) rather than by waiting for their total.
pub const DECODE_WITHIN: usize = 64;

/// How a data type is laid out on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Fixed-width values of this many bytes.
    Fixed(usize),
    /// A bitmap of booleans.
    Bits,
    /// Offsets of this many bytes (4 or 8) into a byte buffer.
    Var(usize),
    /// u32 codes into a dictionary of strings (see [`DeviceDictionary`]).
    Dict,
}

/// The device type of dictionary-encoded strings: u32 codes into utf8 strings.
pub fn dictionary_type() -> DataType {
    DataType::Dictionary(Box::new(DataType::UInt32), Box::new(DataType::Utf8))
}

/// The device layout of `data_type`, or `None` when it must be converted first or is not
/// supported on the device.
pub fn layout_of(data_type: &DataType) -> Option<Layout> {
    use DataType::*;
    Some(match data_type {
        Int8 | UInt8 => Layout::Fixed(1),
        Int16 | UInt16 | Float16 => Layout::Fixed(2),
        Int32 | UInt32 | Float32 | Date32 | Time32(_) => Layout::Fixed(4),
        Int64 | UInt64 | Float64 | Date64 | Time64(_) | Timestamp(_, _) | Duration(_) => {
            Layout::Fixed(8)
        }
        Decimal128(p, _) if *p <= NARROW_DECIMAL_PRECISION => Layout::Fixed(8),
        Decimal128(_, _) => Layout::Fixed(16),
        Boolean => Layout::Bits,
        Utf8 | Binary => Layout::Var(4),
        LargeUtf8 | LargeBinary => Layout::Var(8),
        Dictionary(key, value) if **key == UInt32 && **value == Utf8 => Layout::Dict,
        _ => return None,
    })
}

/// The type a column has on the device: itself, or what it is converted to on upload.
pub fn device_type(data_type: &DataType, value_bytes: usize) -> Result<DataType> {
    let large = value_bytes > i32::MAX as usize;
    let converted = match data_type {
        DataType::Utf8View => {
            if large {
                DataType::LargeUtf8
            } else {
                DataType::Utf8
            }
        }
        DataType::BinaryView => {
            if large {
                DataType::LargeBinary
            } else {
                DataType::Binary
            }
        }
        DataType::Dictionary(_, value) => return device_type(value, value_bytes),
        other => other.clone(),
    };
    if layout_of(&converted).is_none() {
        return Err(KernelError::Unsupported(format!(
            "columns of type {data_type}"
        )));
    }
    Ok(converted)
}

/// The bytes a view array's values take once laid out end to end (what decides whether its
/// offsets need 64 bits on the device): the lengths its views give, for its own rows. Not
/// the size of its buffers, which a slice or a concatenation of slices shares with other
/// arrays: a column concatenated from slices of larger batches (the cache makes its chunks
/// so) can count gigabytes of buffers for megabytes of strings, and went up with 64-bit
/// offsets, which no plan expects (TPC-H SF 0.1's `o_comment` in one chunk). Other types:
/// their buffers' size (only views are converted by it).
fn string_bytes(array: &dyn Array) -> usize {
    use arrow::array::AsArray;
    let lengths = |views: &[u128]| views.iter().map(|&v| v as u32 as usize).sum();
    match array.data_type() {
        DataType::Utf8View => lengths(array.as_string_view().views()),
        DataType::BinaryView => lengths(array.as_binary_view().views()),
        _ => array.get_buffer_memory_size(),
    }
}

/// Uploads a variable-width column's bytes and its offsets, rebased to start at 0.
fn upload_var<O>(device: &Device, data: &ArrayData) -> Result<(DeviceBuffer, Option<DeviceBuffer>)>
where
    O: arrow::datatypes::ArrowNativeType + std::ops::Sub<Output = O> + Copy,
{
    let (len, offset) = (data.len(), data.offset());
    let all: &[O] = data.buffers()[0].typed_data();
    let window = &all[offset..=offset + len];
    let first = window[0];
    let rebased =
        arrow::buffer::Buffer::from_vec(window.iter().map(|&o| o - first).collect::<Vec<O>>());
    let bytes = &data.buffers()[1].as_slice()[first.as_usize()..window[len].as_usize()];
    Ok((
        device.upload(bytes)?,
        Some(device.upload(rebased.as_slice())?),
    ))
}

/// Uploads 128-bit decimal values as 64-bit ones, narrowed in the copy into pinned staging
/// (little endian: a value's low 8 bytes are the value, when it fits). A valid value that
/// does not fit (beyond the type's precision, which Arrow does not always check) is an
/// error; under a NULL any bits may stand (an accumulator's identity, say), and they go up
/// truncated.
fn upload_narrowed(
    device: &Device,
    wide: &[u8],
    nulls: Option<&NullBuffer>,
    data_type: &DataType,
) -> Result<DeviceBuffer> {
    let rows = wide.len() / 16;
    let buffer = device.alloc((rows * 8).max(1))?;
    if rows == 0 {
        return Ok(buffer);
    }
    let overflow = std::cell::Cell::new(false);
    device.write_with(&buffer, 0, rows * 8, &|start, out| {
        let first = start / 8;
        let mut fits = true;
        for (k, value) in out.chunks_exact_mut(8).enumerate() {
            let from = &wide[(first + k) * 16..(first + k + 1) * 16];
            // The high half must be the low half's sign, repeated.
            let sign = if from[7] & 0x80 != 0 { 0xFF } else { 0 };
            fits &=
                from[8..].iter().all(|&b| b == sign) || nulls.is_some_and(|n| n.is_null(first + k));
            value.copy_from_slice(&from[..8]);
        }
        if !fits {
            overflow.set(true);
        }
    })?;
    if overflow.get() {
        return Err(KernelError::Unsupported(format!(
            "a {data_type} value beyond its precision"
        )));
    }
    Ok(buffer)
}

/// 64-bit decimal values (the first `rows` of `narrow`) widened to Arrow's 128 bits.
fn widened(narrow: &[u8], rows: usize) -> arrow::buffer::Buffer {
    let mut wide = MutableBuffer::with_capacity(rows * 16);
    for value in narrow.chunks_exact(8).take(rows) {
        let v = i64::from_le_bytes(value.try_into().expect("8 bytes")) as i128;
        wide.extend_from_slice(&v.to_le_bytes());
    }
    wide.into()
}

/// One column in device memory. Clones share the buffers (operators pass columns through
/// without copying them); the memory goes back to the device when the last clone drops.
#[derive(Debug, Clone)]
pub struct DeviceColumn {
    data_type: DataType,
    len: usize,
    values: Arc<DeviceBuffer>,
    offsets: Option<Arc<DeviceBuffer>>,
    validity: Option<Arc<DeviceBuffer>>,
    /// The dictionary that a dictionary-encoded column's codes index.
    dictionary: Option<Arc<DeviceDictionary>>,
}

/// The strings that the codes of dictionary-encoded columns index, on one device: a utf8
/// column of at least one string, and a 16-byte header holding its offsets' and bytes'
/// addresses, which a program's column table points to (`OP_LOAD_DICT`). Columns share it
/// (their codes compare equal only when they index the same dictionary); the host keeps a
/// copy of the strings, so that a download moves only the codes.
#[derive(Debug)]
pub struct DeviceDictionary {
    strings: DeviceColumn,
    header: DeviceBuffer,
    host: ArrayRef,
    /// The longest string's bytes.
    longest: usize,
}

impl DeviceDictionary {
    /// Copies `strings` (no NULL among them, at least one, under 2 GiB of bytes) to
    /// `device`.
    pub fn upload(device: &Device, strings: &arrow::array::StringArray) -> Result<Arc<Self>> {
        if strings.is_empty() || strings.null_count() > 0 {
            return Err(KernelError::Unsupported(
                "a dictionary of no strings, or with a NULL among them".into(),
            ));
        }
        let column = DeviceColumn::upload(device, strings)?;
        if column.layout() != Layout::Var(4) {
            return Err(KernelError::Unsupported(format!(
                "a dictionary of {} strings",
                column.data_type()
            )));
        }
        let offsets = column.offsets().map_or(0, DeviceBuffer::addr);
        let words = [offsets, column.values().addr()];
        let header = device.upload(&words.map(u64::to_le_bytes).concat())?;
        let longest = (0..strings.len())
            .map(|i| strings.value_length(i) as usize)
            .max()
            .unwrap_or(0);
        Ok(Arc::new(Self {
            strings: column,
            header,
            host: Arc::new(strings.clone()),
            longest,
        }))
    }

    /// How many strings.
    pub fn len(&self) -> usize {
        self.strings.len()
    }

    /// Whether it has no strings (never: an upload refuses that).
    pub fn is_empty(&self) -> bool {
        self.strings.is_empty()
    }

    /// The strings, on the host.
    pub fn host(&self) -> &ArrayRef {
        &self.host
    }

    /// The strings, on the device.
    pub fn strings(&self) -> &DeviceColumn {
        &self.strings
    }

    /// The header a program's column table points to: the strings' offsets and bytes.
    pub fn header(&self) -> &DeviceBuffer {
        &self.header
    }

    /// Device bytes it occupies.
    pub fn device_bytes(&self) -> usize {
        self.strings.device_bytes() + self.header.len()
    }

    /// The bytes it holds of its device's budget.
    pub fn reserved_bytes(&self) -> usize {
        self.strings.reserved_bytes() + self.header.reserved()
    }

    /// The device buffers a kernel reading through the header reaches.
    pub fn buffers(&self) -> [&DeviceBuffer; 3] {
        [
            &self.header,
            self.strings.values(),
            self.strings.offsets().unwrap_or(&self.header),
        ]
    }
}

fn bitmap_bytes(len: usize) -> usize {
    len.div_ceil(8)
}

impl DeviceColumn {
    /// Assembles a column from device buffers in the layout above.
    pub fn from_parts(
        data_type: DataType,
        len: usize,
        values: DeviceBuffer,
        offsets: Option<DeviceBuffer>,
        validity: Option<DeviceBuffer>,
    ) -> Self {
        Self {
            data_type,
            len,
            values: Arc::new(values),
            offsets: offsets.map(Arc::new),
            validity: validity.map(Arc::new),
            dictionary: None,
        }
    }

    /// A dictionary-encoded column: `codes` (a UInt32 column) indexing `dictionary`, on
    /// the same device.
    ///
    /// # Safety
    /// Every code, NULL rows' included, must be below `dictionary.len()`: kernels read the
    /// dictionary at the codes unchecked.
    pub unsafe fn with_dictionary(
        codes: DeviceColumn,
        dictionary: Arc<DeviceDictionary>,
    ) -> Result<Self> {
        if codes.data_type() != &DataType::UInt32 || codes.device() != dictionary.strings.device() {
            return Err(KernelError::Unsupported(format!(
                "dictionary codes of type {} on {} for a dictionary on {}",
                codes.data_type(),
                codes.device(),
                dictionary.strings.device()
            )));
        }
        Ok(Self {
            data_type: dictionary_type(),
            dictionary: Some(dictionary),
            ..codes
        })
    }

    /// The type of the column's values: its strings' (utf8) for a dictionary-encoded
    /// column, else its type. Keys compare by it.
    pub fn value_type(&self) -> &DataType {
        match self.dictionary {
            Some(_) => &DataType::Utf8,
            None => &self.data_type,
        }
    }

    /// The dictionary a dictionary-encoded column's codes index.
    pub fn dictionary(&self) -> Option<&Arc<DeviceDictionary>> {
        self.dictionary.as_ref()
    }

    /// The column with its codes (for a dictionary-encoded one: a UInt32 column).
    pub(crate) fn codes(&self) -> Self {
        match self.dictionary {
            Some(_) => Self {
                data_type: DataType::UInt32,
                dictionary: None,
                ..self.clone()
            },
            None => self.clone(),
        }
    }

    /// `codes` (gathered or concatenated from this column's codes) as a column of this
    /// column's dictionary, or as they are when this column has none.
    pub(crate) fn recoded(&self, codes: Self) -> Self {
        match &self.dictionary {
            Some(d) => Self {
                data_type: dictionary_type(),
                dictionary: Some(Arc::clone(d)),
                ..codes
            },
            None => codes,
        }
    }

    /// The column with its strings in place of its codes (a gather of the dictionary's
    /// strings by code, with the codes' validity); any other column as it is. No host wait
    /// where the dictionary's strings are short (at most [`DECODE_WITHIN`] bytes): the
    /// bytes are sized by the longest, instead of by a total read back; else one wait.
    pub fn decoded(&self) -> Result<Self> {
        let Some(dictionary) = &self.dictionary else {
            return Ok(self.clone());
        };
        let indices =
            crate::ops::RowIndices::of_codes(Arc::clone(&self.values), self.len, dictionary.len());
        let strings = match dictionary.longest <= DECODE_WITHIN {
            true => crate::ops::gather::gather_strings_within(
                &dictionary.strings,
                &indices,
                self.len.saturating_mul(dictionary.longest),
            )?,
            false => crate::ops::gather::gather_column(&dictionary.strings, &indices)?,
        };
        Ok(Self {
            validity: self.validity.clone(),
            ..strings
        })
    }

    /// The first `len` rows (all of them if there are fewer), sharing this column's
    /// buffers: the layout starts every buffer at row 0, so a prefix is the same buffers
    /// read for fewer rows.
    pub fn prefix(&self, len: usize) -> Self {
        Self {
            len: len.min(self.len),
            ..self.clone()
        }
    }

    /// Copies an Arrow array to `device`.
    pub fn upload(device: &Device, array: &dyn Array) -> Result<Self> {
        let target = device_type(array.data_type(), string_bytes(array))?;
        let converted;
        let array: &dyn Array = if &target != array.data_type() {
            converted =
                cast(array, &target).map_err(|e| KernelError::Unsupported(e.to_string()))?;
            converted.as_ref()
        } else {
            array
        };
        let data = array.to_data();
        let (len, offset) = (data.len(), data.offset());
        let validity = match data.nulls() {
            Some(nulls) if nulls.null_count() > 0 => {
                let bits = nulls.inner().sliced();
                Some(device.upload(&bits.as_slice()[..bitmap_bytes(len)])?)
            }
            _ => None,
        };
        let layout =
            layout_of(&target).ok_or_else(|| KernelError::Unsupported(format!("{target}")))?;
        let (values, offsets) = match layout {
            Layout::Fixed(8) if is_narrow_decimal(&target) => {
                let wide = &data.buffers()[0].as_slice()[offset * 16..(offset + len) * 16];
                (upload_narrowed(device, wide, data.nulls(), &target)?, None)
            }
            Layout::Fixed(width) => {
                let bytes = &data.buffers()[0].as_slice()[offset * width..(offset + len) * width];
                (device.upload(bytes)?, None)
            }
            Layout::Bits => {
                let bits = BooleanBuffer::new(data.buffers()[0].clone(), offset, len).sliced();
                (device.upload(&bits.as_slice()[..bitmap_bytes(len)])?, None)
            }
            Layout::Var(4) => upload_var::<i32>(device, &data)?,
            Layout::Var(_) => upload_var::<i64>(device, &data)?,
            Layout::Dict => {
                return Err(KernelError::Unsupported(
                    "uploading dictionary codes without their dictionary".into(),
                ));
            }
        };
        Ok(Self::from_parts(target, len, values, offsets, validity))
    }

    /// Copies the column back into an Arrow array (one host wait for all its buffers).
    pub fn to_arrow(&self) -> Result<ArrayRef> {
        let mut arrays = download_columns(&[self])?;
        arrays
            .pop()
            .ok_or_else(|| KernelError::InvalidData("a download of one column made none".into()))
    }

    /// The column's type on the device.
    pub fn data_type(&self) -> &DataType {
        &self.data_type
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the column has no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values buffer (fixed-width values, boolean bits, or string bytes).
    pub fn values(&self) -> &DeviceBuffer {
        &self.values
    }

    /// The offsets buffer of a variable-width column.
    pub fn offsets(&self) -> Option<&DeviceBuffer> {
        self.offsets.as_deref()
    }

    /// The validity bitmap, absent when no row is NULL.
    pub fn validity(&self) -> Option<&DeviceBuffer> {
        self.validity.as_deref()
    }

    /// The device layout.
    pub fn layout(&self) -> Layout {
        layout_of(&self.data_type).unwrap_or(Layout::Fixed(1))
    }

    /// Bytes the column occupies on the device (what an upload or download moves).
    pub fn device_bytes(&self) -> usize {
        self.values.len()
            + self.offsets.as_ref().map_or(0, |b| b.len())
            + self.validity.as_ref().map_or(0, |b| b.len())
    }

    /// The bytes the column holds of its device's budget (each buffer's size class), as
    /// the device's memory usage counts them.
    pub fn reserved_bytes(&self) -> usize {
        self.values.reserved()
            + self.offsets.as_ref().map_or(0, |b| b.reserved())
            + self.validity.as_ref().map_or(0, |b| b.reserved())
    }

    /// The device holding the column.
    pub fn device(&self) -> &Device {
        self.values.device()
    }
}

/// Copies columns back into Arrow arrays, all their buffers in one host wait (one per
/// 16 MiB of staging past that) when they are on one device.
pub fn download_columns(columns: &[&DeviceColumn]) -> Result<Vec<ArrayRef>> {
    match columns.first() {
        None => Ok(Vec::new()),
        Some(first) => download_columns_with(first.device(), columns, &mut []),
    }
}

/// [`download_columns`], with more reads from `device` (`extra`: each buffer's first
/// `out.len()` bytes) in the same host wait.
pub(crate) fn download_columns_with(
    device: &Device,
    columns: &[&DeviceColumn],
    extra: &mut [(&DeviceBuffer, &mut [u8])],
) -> Result<Vec<ArrayRef>> {
    if columns.iter().any(|c| c.device() != device) {
        if !extra.is_empty() {
            device.read_many(extra)?;
        }
        return columns.iter().map(|c| c.to_arrow()).collect();
    }
    // A host buffer for every device buffer: validity, offsets, values.
    let zeroed = |b: &DeviceBuffer| MutableBuffer::from_len_zeroed(b.len());
    let mut host: Vec<(Option<MutableBuffer>, Option<MutableBuffer>, MutableBuffer)> = columns
        .iter()
        .map(|c| {
            (
                c.validity.as_deref().map(zeroed),
                c.offsets.as_deref().map(zeroed),
                zeroed(&c.values),
            )
        })
        .collect();
    {
        let mut reads: Vec<(&DeviceBuffer, &mut [u8])> = Vec::new();
        for (c, (validity, offsets, values)) in columns.iter().zip(host.iter_mut()) {
            if let (Some(d), Some(h)) = (c.validity.as_deref(), validity.as_mut()) {
                reads.push((d, h.as_slice_mut()));
            }
            if let (Some(d), Some(h)) = (c.offsets.as_deref(), offsets.as_mut()) {
                reads.push((d, h.as_slice_mut()));
            }
            reads.push((&c.values, values.as_slice_mut()));
        }
        reads.extend(extra.iter_mut().map(|(b, out)| (*b, &mut **out)));
        if !reads.is_empty() {
            device.read_many(&mut reads)?;
        }
    }
    columns
        .iter()
        .zip(host)
        .map(|(c, (validity, offsets, values))| {
            let nulls = validity
                .map(|v| NullBuffer::new(BooleanBuffer::new(v.into(), 0, c.len)))
                .filter(|n| n.null_count() > 0);
            if let Some(dictionary) = &c.dictionary {
                // The codes and the host's copy of the strings.
                let codes = arrow::buffer::ScalarBuffer::new(values.into(), 0, c.len);
                let codes = arrow::array::UInt32Array::new(codes, nulls);
                let array =
                    arrow::array::DictionaryArray::try_new(codes, Arc::clone(dictionary.host()))
                        .map_err(|e| KernelError::InvalidData(format!("dictionary column: {e}")))?;
                return Ok(Arc::new(array) as ArrayRef);
            }
            let mut builder = ArrayData::builder(c.data_type.clone())
                .len(c.len)
                .nulls(nulls);
            if let Some(offsets) = offsets {
                builder = builder.add_buffer(offsets.into());
            }
            let values = if is_narrow_decimal(&c.data_type) {
                widened(values.as_slice(), c.len)
            } else {
                values.into()
            };
            let data = builder
                .add_buffer(values)
                .build()
                .map_err(|e| KernelError::InvalidData(format!("{} column: {e}", c.data_type)))?;
            Ok(make_array(data))
        })
        .collect()
}

/// A batch of columns on one device.
#[derive(Debug, Clone)]
pub struct DeviceBatch {
    schema: SchemaRef,
    columns: Vec<DeviceColumn>,
    num_rows: usize,
}

impl DeviceBatch {
    /// Copies a record batch to `device`. The schema keeps the original field names and
    /// nullability, with the device types of converted columns.
    pub fn upload(device: &Device, batch: &RecordBatch) -> Result<Self> {
        let columns = batch
            .columns()
            .iter()
            .map(|c| DeviceColumn::upload(device, c.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let fields: Vec<_> = batch
            .schema()
            .fields()
            .iter()
            .zip(&columns)
            .map(|(f, c)| f.as_ref().clone().with_data_type(c.data_type().clone()))
            .collect();
        Ok(Self {
            schema: Arc::new(arrow::datatypes::Schema::new_with_metadata(
                fields,
                batch.schema().metadata().clone(),
            )),
            columns,
            num_rows: batch.num_rows(),
        })
    }

    /// Assembles a batch from columns of `num_rows` rows each.
    pub fn try_new(schema: SchemaRef, columns: Vec<DeviceColumn>, num_rows: usize) -> Result<Self> {
        if columns.len() != schema.fields().len() || columns.iter().any(|c| c.len() != num_rows) {
            return Err(KernelError::InvalidData(
                "columns do not match the schema or the row count".into(),
            ));
        }
        Ok(Self {
            schema,
            columns,
            num_rows,
        })
    }

    /// Copies the batch back to the host.
    pub fn to_record_batch(&self) -> Result<RecordBatch> {
        let arrays = download_columns(&self.columns.iter().collect::<Vec<_>>())?;
        RecordBatch::try_new_with_options(
            Arc::clone(&self.schema),
            arrays,
            &arrow::array::RecordBatchOptions::new().with_row_count(Some(self.num_rows)),
        )
        .map_err(|e| KernelError::InvalidData(e.to_string()))
    }

    /// The schema (device types).
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// The columns.
    pub fn columns(&self) -> &[DeviceColumn] {
        &self.columns
    }

    /// Rows.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }
}
