//! Expression programs (`cuda/expr.cu`, `cuda/expr.cuh`): a compact stack-machine program
//! that one fused kernel evaluates per row. The engine compiles DataFusion expressions into a [`Program`];
//! this module checks the program against the columns it reads and launches it.
//!
//! ```text
//! instruction = [opcode | aux << 8, arg]    (two i64 words)
//! LOAD_I32 aux=slot   CONST arg=k   ADD_I aux=kind   CMP_F aux=LT   OUT aux=output
//! ```

use super::{BLOCK, check_rows};
use crate::column::{DeviceColumn, Layout};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};
use arrow::datatypes::DataType;

/// Most values a program may hold at once (the kernel's per-thread stack).
pub const MAX_STACK: usize = 32;
/// Most outputs one program may write.
pub const MAX_OUTPUTS: usize = 64;

/// Opcodes, as `enum ExprOp` in `cuda/expr.cuh` numbers them.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    LoadI8 = 1,
    LoadI16,
    LoadI32,
    LoadI64,
    LoadU8,
    LoadU16,
    LoadU32,
    LoadF32,
    LoadF64,
    LoadBool,
    LoadDec,
    LoadDec64,
    LoadStr32,
    LoadStr64,
    Const,
    StrConst,
    Null,
    AddI,
    SubI,
    MulI,
    DivI,
    ModI,
    NegI,
    AddF,
    SubF,
    MulF,
    DivF,
    ModF,
    NegF,
    AddD,
    SubD,
    MulD,
    NegD,
    DivD,
    ModD,
    CmpI,
    CmpF,
    CmpD,
    CmpS,
    And,
    Or,
    Not,
    IsNull,
    IsNotNull,
    Select,
    CastII,
    CastIF,
    CastFI,
    CastFF,
    CastID,
    CastDD,
    CastDF,
    CastFD,
    CastDateTs,
    CastTsDate,
    CastTsTs,
    StrPrefix,
    StrSuffix,
    StrContains,
    StrLike,
    Substr,
    DatePart,
    DateTrunc,
    Out,
    /// A dictionary-encoded column's string at the row's code. Programs are compiled with
    /// `LoadStr32`; a launch over a dictionary-encoded column loads it this way instead.
    LoadDict,
}

impl Op {
    /// Values the op pops and pushes.
    fn stack_effect(self, aux: i64) -> (usize, usize) {
        use Op::*;
        match self {
            LoadI8 | LoadI16 | LoadI32 | LoadI64 | LoadU8 | LoadU16 | LoadU32 | LoadF32
            | LoadF64 | LoadBool | LoadDec | LoadDec64 | LoadStr32 | LoadStr64 | LoadDict
            | Const | StrConst | Null => (0, 1),
            AddI | SubI | MulI | DivI | ModI | AddF | SubF | MulF | DivF | ModF | AddD | SubD
            | MulD | DivD | ModD | CmpI | CmpF | CmpD | CmpS | And | Or | StrPrefix | StrSuffix
            | StrContains | StrLike => (2, 1),
            NegI | NegF | NegD | Not | IsNull | IsNotNull | CastII | CastIF | CastFI | CastFF
            | CastID | CastDD | CastDF | CastFD | CastDateTs | CastTsDate | CastTsTs | DatePart
            | DateTrunc => (1, 1),
            Select => (3, 1),
            Substr => (aux.clamp(2, 3) as usize, 1),
            Out => (1, 0),
        }
    }

    /// The column layout a load reads, if the op is a load.
    fn load_layout(self) -> Option<Layout> {
        use Op::*;
        Some(match self {
            LoadI8 | LoadU8 => Layout::Fixed(1),
            LoadI16 | LoadU16 => Layout::Fixed(2),
            LoadI32 | LoadU32 | LoadF32 => Layout::Fixed(4),
            LoadI64 | LoadF64 | LoadDec64 => Layout::Fixed(8),
            LoadDec => Layout::Fixed(16),
            LoadBool => Layout::Bits,
            LoadStr32 => Layout::Var(4),
            LoadStr64 => Layout::Var(8),
            LoadDict => Layout::Dict,
            _ => return None,
        })
    }
}

/// Integer kinds (`enum IntKind`): the range an integer result must fit.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntKind {
    I8 = 0,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
}

/// What an output holds (`enum OutKind`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutKind {
    I8 = 0,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    F32,
    F64,
    Bool,
    /// A decimal, in 16 bytes.
    Decimal,
    /// A decimal of precision at most 18 (`column::NARROW_DECIMAL_PRECISION`), in 8 bytes.
    Decimal64,
    /// A string (its bytes where the input holds them, and its length): only a program
    /// whose outputs stay in registers may have one (`super::aggregate::FusedSpec`), since
    /// the kernel writes no string column.
    Str,
}

impl OutKind {
    /// Bytes of values for `n` rows (`None`: a register-only kind).
    fn value_bytes(self, n: usize) -> Option<usize> {
        Some(match self.layout()? {
            Layout::Fixed(width) => width * n,
            // Written one 32-bit word per warp.
            Layout::Bits | Layout::Var(_) | Layout::Dict => n.div_ceil(32) * 4,
        })
    }

    /// The device layout of the output (`None`: a register-only kind).
    fn layout(self) -> Option<Layout> {
        Some(match self {
            Self::I8 | Self::U8 => Layout::Fixed(1),
            Self::I16 | Self::U16 => Layout::Fixed(2),
            Self::I32 | Self::U32 | Self::F32 => Layout::Fixed(4),
            Self::I64 | Self::F64 | Self::Decimal64 => Layout::Fixed(8),
            Self::Bool => Layout::Bits,
            Self::Decimal => Layout::Fixed(16),
            Self::Str => return None,
        })
    }
}

/// Comparisons (`enum Cmp`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq = 0,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// Makes `Cmp::Eq` "IS NOT DISTINCT FROM" and `Cmp::Ne` "IS DISTINCT FROM".
pub const CMP_NULL_SAFE: i64 = 8;

/// A compiled program: instructions, constants, and the type of each output.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Program {
    code: Vec<i64>,
    consts: Vec<i64>,
    strings: Vec<u8>,
    outputs: Vec<(OutKind, DataType)>,
    /// Values on the stack after the last instruction, and the most at any point.
    depth: usize,
    max_depth: usize,
}

impl Program {
    /// An empty program.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends an instruction.
    pub fn push(&mut self, op: Op, aux: i64, arg: i64) {
        self.code.push(op as i64 | (aux << 8));
        self.code.push(arg);
        let (pops, pushes) = op.stack_effect(aux);
        self.depth = self.depth.saturating_sub(pops) + pushes;
        self.max_depth = self.max_depth.max(self.depth);
    }

    /// The most values the program holds on its stack at once (at most [`MAX_STACK`] for
    /// the kernel to run it; `validate` checks).
    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// Adds a constant (`lo`, `hi` as the kernel reads them; `None` is NULL) and returns
    /// its index for `Op::Const`.
    pub fn constant(&mut self, value: Option<(i64, i64)>) -> i64 {
        let (lo, hi) = value.unwrap_or((0, 0));
        self.consts.extend([lo, hi, i64::from(value.is_some())]);
        (self.consts.len() / 3 - 1) as i64
    }

    /// Replaces constant `k` (a value known only when the batch runs, such as a scalar
    /// subquery's result). An index out of range changes nothing.
    pub fn set_constant(&mut self, k: i64, value: Option<(i64, i64)>) {
        let (lo, hi) = value.unwrap_or((0, 0));
        if let Some(slot) = usize::try_from(k)
            .ok()
            .and_then(|k| self.consts.get_mut(3 * k..3 * k + 3))
        {
            slot.copy_from_slice(&[lo, hi, i64::from(value.is_some())]);
        }
    }

    /// Adds a string constant and returns its index for `Op::StrConst`.
    pub fn string_constant(&mut self, bytes: &[u8]) -> i64 {
        let at = self.strings.len() as i64;
        self.strings.extend_from_slice(bytes);
        self.constant(Some((at, bytes.len() as i64)))
    }

    /// Appends `OUT` for a new output of this kind and Arrow type; returns its index.
    pub fn output(&mut self, kind: OutKind, data_type: DataType) -> usize {
        let index = self.outputs.len();
        self.outputs.push((kind, data_type));
        self.push(Op::Out, index as i64, 0);
        index
    }

    /// Instructions so far.
    pub fn len(&self) -> usize {
        self.code.len() / 2
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.code.is_empty()
    }

    /// The outputs' Arrow types.
    pub fn output_types(&self) -> impl Iterator<Item = &DataType> {
        self.outputs.iter().map(|(_, t)| t)
    }

    /// Output `k`'s kind and Arrow type.
    pub fn output_at(&self, k: usize) -> Option<&(OutKind, DataType)> {
        self.outputs.get(k)
    }

    /// The number of outputs.
    pub fn output_count(&self) -> usize {
        self.outputs.len()
    }

    /// Checks what the kernel trusts: every opcode known, the stack within bounds and
    /// empty at the end, constant, string and output indices in range, and each load
    /// reading a column of the layout it expects.
    pub fn validate(&self, columns: &[&DeviceColumn]) -> Result<()> {
        let bad = |what: String| {
            Err(KernelError::Unsupported(format!(
                "expression program: {what}"
            )))
        };
        if self.outputs.len() > MAX_OUTPUTS {
            return bad(format!(
                "{} outputs (at most {MAX_OUTPUTS})",
                self.outputs.len()
            ));
        }
        let mut depth = 0usize;
        let mut outputs_written = 0usize;
        for pc in 0..self.len() {
            let word = self.code[2 * pc];
            let arg = self.code[2 * pc + 1];
            let aux = word >> 8;
            let Some(op) = op_from(word & 0xFF) else {
                return bad(format!("unknown opcode {}", word & 0xFF));
            };
            let (pops, pushes) = op.stack_effect(aux);
            if depth < pops {
                return bad(format!("{op:?} at {pc} pops an empty stack"));
            }
            depth = depth - pops + pushes;
            if depth > MAX_STACK {
                return bad(format!("more than {MAX_STACK} values at once"));
            }
            if let Some(layout) = op.load_layout() {
                let column = usize::try_from(arg).ok().and_then(|i| columns.get(i));
                match column {
                    Some(c) if c.layout() == layout => {}
                    // A string load reads a dictionary-encoded column through its dictionary.
                    Some(c) if op == Op::LoadStr32 && c.layout() == Layout::Dict => {}
                    _ => return bad(format!("{op:?} of column {arg} ({layout:?})")),
                }
            }
            match op {
                Op::Const | Op::StrConst => {
                    let k = usize::try_from(arg).unwrap_or(usize::MAX);
                    if k >= self.consts.len() / 3 {
                        return bad(format!("constant {arg}"));
                    }
                    if op == Op::StrConst {
                        let (at, len) = (self.consts[3 * k], self.consts[3 * k + 1]);
                        if at < 0 || len < 0 || (at + len) as usize > self.strings.len() {
                            return bad(format!("string constant {arg}"));
                        }
                    }
                }
                Op::Out => {
                    if aux != outputs_written as i64 || outputs_written >= self.outputs.len() {
                        return bad(format!("output {aux}"));
                    }
                    outputs_written += 1;
                }
                Op::Substr if !(2..=3).contains(&aux) => return bad("substr arity".into()),
                Op::CastDateTs | Op::CastTsDate | Op::DateTrunc if arg <= 0 => {
                    return bad(format!("{op:?} by {arg}"));
                }
                Op::DatePart if arg < 0 => return bad(format!("{op:?} by {arg}")),
                Op::CastTsTs if arg == 0 => return bad("timestamp cast by 0".into()),
                _ => {}
            }
        }
        if depth != 0 || outputs_written != self.outputs.len() {
            return bad("values left on the stack or outputs not written".into());
        }
        Ok(())
    }
}

/// Every opcode, in numbering order.
pub const ALL_OPS: &[Op] = &[
    Op::LoadI8,
    Op::LoadI16,
    Op::LoadI32,
    Op::LoadI64,
    Op::LoadU8,
    Op::LoadU16,
    Op::LoadU32,
    Op::LoadF32,
    Op::LoadF64,
    Op::LoadBool,
    Op::LoadDec,
    Op::LoadDec64,
    Op::LoadStr32,
    Op::LoadStr64,
    Op::Const,
    Op::StrConst,
    Op::Null,
    Op::AddI,
    Op::SubI,
    Op::MulI,
    Op::DivI,
    Op::ModI,
    Op::NegI,
    Op::AddF,
    Op::SubF,
    Op::MulF,
    Op::DivF,
    Op::ModF,
    Op::NegF,
    Op::AddD,
    Op::SubD,
    Op::MulD,
    Op::NegD,
    Op::DivD,
    Op::ModD,
    Op::CmpI,
    Op::CmpF,
    Op::CmpD,
    Op::CmpS,
    Op::And,
    Op::Or,
    Op::Not,
    Op::IsNull,
    Op::IsNotNull,
    Op::Select,
    Op::CastII,
    Op::CastIF,
    Op::CastFI,
    Op::CastFF,
    Op::CastID,
    Op::CastDD,
    Op::CastDF,
    Op::CastFD,
    Op::CastDateTs,
    Op::CastTsDate,
    Op::CastTsTs,
    Op::StrPrefix,
    Op::StrSuffix,
    Op::StrContains,
    Op::StrLike,
    Op::Substr,
    Op::DatePart,
    Op::DateTrunc,
    Op::Out,
    Op::LoadDict,
];

fn op_from(code: i64) -> Option<Op> {
    ALL_OPS.iter().copied().find(|&op| op as i64 == code)
}

/// Tables of 64-bit words laid end to end for one upload: the bytes, and each table's
/// (offset, length in bytes). An empty table still gets an 8-byte slot (an address the
/// kernel never reads), so that every offset lies inside the upload.
struct Tables {
    bytes: Vec<u8>,
    ranges: Vec<(usize, usize)>,
}

impl Tables {
    fn new(tables: &[&[i64]]) -> Self {
        let mut bytes = Vec::new();
        let mut ranges = Vec::with_capacity(tables.len());
        for words in tables {
            let offset = bytes.len();
            bytes.extend(words.iter().flat_map(|w| w.to_le_bytes()));
            if words.is_empty() {
                bytes.extend([0; 8]);
            }
            ranges.push((offset, bytes.len() - offset));
        }
        Self { bytes, ranges }
    }
}

/// Runs `program` over `n` rows of `columns` (the program's load slots, in order).
/// Returns the output columns, or `None` when some row met a case the program leaves to
/// the CPU (overflow, division by zero, a cast out of range): the caller redoes the batch
/// on the CPU.
pub fn evaluate(
    device: &Device,
    program: &Program,
    columns: &[&DeviceColumn],
    n: usize,
) -> Result<Option<Vec<DeviceColumn>>> {
    let (outputs, error) = launch(device, program, columns, n, None)?;
    if let Some(error) = error
        && error.prefix_to_host(4)?.iter().any(|&b| b != 0)
    {
        return Ok(None);
    }
    Ok(Some(outputs))
}

/// Queues `program` over `n` rows of `columns` without waiting for it: the kernel sets
/// word 1 of `status` (a [`STATUS_BYTES`](super::STATUS_BYTES) buffer the
/// caller zeroed) when some row met a case it leaves to the CPU, and the outputs are then
/// not to be used. The consumer checks the word in its own host wait
/// ([`GroupTable::update_with`](super::aggregate::GroupTable::update_with),
/// [`read_status`](super::read_status) after a queued selection, or
/// [`download_checked`](super::download_checked) with the outputs themselves). Reading the
/// outputs before that is safe, never right: they are fixed-width values and validity
/// bits, always within their buffers, but a failed program's values are not its answer,
/// so whatever was made of them must be undone.
pub fn evaluate_unchecked(
    device: &Device,
    program: &Program,
    columns: &[&DeviceColumn],
    n: usize,
    status: &DeviceBuffer,
) -> Result<Vec<DeviceColumn>> {
    if status.len() < super::STATUS_BYTES {
        return Err(KernelError::Unsupported(
            "a status buffer too short for an error word".into(),
        ));
    }
    launch(device, program, columns, n, Some(status)).map(|(outputs, _)| outputs)
}

/// A program's tables packed for one upload (`pack`): the caller's leading words, the
/// code, constants and column table as 64-bit words, then the caller's trailing tables, then
/// the string constants.
pub(crate) struct Packed {
    /// The bytes to upload.
    pub(crate) bytes: Vec<u8>,
    /// (offset, length) of each table: `lead`, code, constants, columns, each of `tail`,
    /// then the strings.
    pub(crate) ranges: Vec<(usize, usize)>,
}

/// Packs `program` over `columns` for one upload: `lead` first (an error or status word
/// the kernel writes), then the program's code, constants and column table, then each
/// table of `tail` (its output table, or a fused kernel's descriptors; an address in a tail
/// table may be an offset into this very upload only if the caller patches it), then the
/// string constants.
pub(crate) fn pack(
    program: &Program,
    columns: &[&DeviceColumn],
    lead: &[i64],
    tail: &[&[i64]],
) -> Packed {
    let mut col_table = Vec::with_capacity(3 * columns.len());
    for c in columns {
        col_table.extend([
            c.values().addr() as i64,
            c.validity().map_or(0, DeviceBuffer::addr) as i64,
            match c.dictionary() {
                Some(d) => d.header().addr() as i64,
                None => c.offsets().map_or(0, DeviceBuffer::addr) as i64,
            },
        ]);
    }
    // String loads of dictionary-encoded columns load through the dictionary.
    let code = match columns.iter().any(|c| c.dictionary().is_some()) {
        false => std::borrow::Cow::Borrowed(&program.code),
        true => {
            let mut code = program.code.clone();
            for pc in 0..code.len() / 2 {
                let (word, arg) = (code[2 * pc], code[2 * pc + 1]);
                let encoded = usize::try_from(arg)
                    .ok()
                    .and_then(|i| columns.get(i))
                    .is_some_and(|c| c.dictionary().is_some());
                if word & 0xFF == Op::LoadStr32 as i64 && encoded {
                    code[2 * pc] = (word & !0xFF) | Op::LoadDict as i64;
                }
            }
            std::borrow::Cow::Owned(code)
        }
    };
    let mut tables: Vec<&[i64]> = vec![lead, &code, &program.consts, &col_table];
    tables.extend_from_slice(tail);
    let Tables {
        mut bytes,
        mut ranges,
    } = Tables::new(&tables);
    ranges.push((bytes.len(), program.strings.len() + 1));
    bytes.extend_from_slice(&program.strings);
    bytes.push(0);
    Packed { bytes, ranges }
}

/// The buffers a program's launch reaches through its column table.
pub(crate) fn reached_columns<'a>(columns: &[&'a DeviceColumn]) -> Vec<&'a DeviceBuffer> {
    let mut reached = Vec::with_capacity(3 * columns.len());
    for c in columns {
        reached.push(c.values());
        reached.extend(c.validity());
        reached.extend(c.offsets());
        if let Some(d) = c.dictionary() {
            reached.extend(d.buffers());
        }
    }
    reached
}

/// Checks that `program` may run over `columns` of `n` rows on `device`.
pub(crate) fn check_inputs(
    device: &Device,
    program: &Program,
    columns: &[&DeviceColumn],
    n: usize,
) -> Result<()> {
    check_rows(n)?;
    program.validate(columns)?;
    if let Some(c) = columns
        .iter()
        .find(|c| c.len() != n || c.device() != device)
    {
        return Err(KernelError::Unsupported(format!(
            "an input column of {} rows on {} for {n} rows on {device}",
            c.len(),
            c.device()
        )));
    }
    Ok(())
}

/// Launches the program; its error word is word 1 of `status`, or else the first word of
/// the returned upload (`None`: nothing was launched, over no rows).
fn launch(
    device: &Device,
    program: &Program,
    columns: &[&DeviceColumn],
    n: usize,
    status: Option<&DeviceBuffer>,
) -> Result<(Vec<DeviceColumn>, Option<DeviceBuffer>)> {
    check_inputs(device, program, columns, n)?;
    if program
        .outputs
        .iter()
        .any(|(kind, _)| kind.layout().is_none())
    {
        return Err(KernelError::Unsupported(
            "a program writing a string column (string outputs stay in registers)".into(),
        ));
    }
    let words = n.div_ceil(32);
    let mut outputs = Vec::with_capacity(program.outputs.len());
    for (kind, data_type) in &program.outputs {
        let bytes = kind.value_bytes(n).unwrap_or(0);
        let values = device.alloc(bytes.max(1))?;
        let validity = device.alloc((words * 4).max(1))?;
        outputs.push((values, validity, *kind, data_type.clone()));
    }
    if n == 0 {
        return Ok((
            outputs
                .into_iter()
                .map(|(v, m, _, t)| DeviceColumn::from_parts(t, 0, v, None, Some(m)))
                .collect(),
            None,
        ));
    }
    let mut out_table = vec![outputs.len() as i64];
    for (values, validity, kind, _) in &outputs {
        out_table.extend([values.addr() as i64, validity.addr() as i64, *kind as i64]);
    }
    // One upload per batch: the error word, then the program, its constants and the
    // column and output tables as 64-bit words, then the string constants.
    let packed = pack(program, columns, &[0], &[&out_table]);
    let upload = device.upload(&packed.bytes)?;
    let at = |k: usize| packed.ranges[k];
    let part = |(offset, len): (usize, usize)| Arg::part(&upload, offset, len);
    let cfg = LaunchConfig::for_items(device, n as u64, BLOCK);
    let mut reached = reached_columns(columns);
    for (values, validity, _, _) in &outputs {
        reached.extend([values, validity]);
    }
    // SAFETY: `validate` checked every opcode, the stack depth (≤ MAX_STACK, the kernel's
    // stack), that loads name existing columns of the layout they read, that constants and
    // string constants are in range, and that outputs are written in order; every column
    // holds `n` rows on this device; each output's values hold `n` values of its kind (or
    // ceil(n/32) words for booleans; no output is register-only) and its validity
    // ceil(n/32) words, which is what the kernel writes; the packed upload holds the error
    // word (zero), the code, constants, column and output tables at 8-byte aligned
    // offsets, and the strings.
    unsafe {
        device.launch_reaching(
            Kernel::expr_eval,
            cfg,
            &[
                part(at(1)),
                Arg::U64(program.len() as u64),
                part(at(2)),
                part(at(5)),
                part(at(3)),
                part(at(4)),
                Arg::U64(n as u64),
                match status {
                    Some(status) => Arg::part(status, 8, 8),
                    None => part(at(0)),
                },
            ],
            &reached,
        )?;
    }
    let outputs = outputs
        .into_iter()
        .map(|(values, validity, _, data_type)| {
            DeviceColumn::from_parts(data_type, n, values, None, Some(validity))
        })
        .collect();
    Ok((outputs, status.is_none().then_some(upload)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel and the host number opcodes alike: `enum ExprOp` in `cuda/expr.cuh` lists
    /// `OP_LOAD_I8, …` in the order of [`ALL_OPS`], starting at 1.
    #[test]
    fn opcodes_match_the_kernel() {
        let source = include_str!("../../cuda/expr.cuh");
        let start = source
            .find("enum ExprOp {")
            .expect("enum ExprOp in expr.cuh");
        let body = &source[start + "enum ExprOp {".len()..];
        let body = &body[..body.find("};").expect("end of enum ExprOp")];
        let kernel: Vec<String> = body
            .split(',')
            .map(|name| name.split('=').next().unwrap_or("").trim())
            .filter(|name| !name.is_empty())
            .map(|name| {
                name.trim_start_matches("OP_")
                    .split('_')
                    .map(|w| {
                        let w = w.to_ascii_lowercase();
                        let (first, rest) = w.split_at(1);
                        format!("{}{rest}", first.to_ascii_uppercase())
                    })
                    .collect::<String>()
            })
            .collect();
        let host: Vec<String> = ALL_OPS.iter().map(|op| format!("{op:?}")).collect();
        assert_eq!(kernel, host);
        for (i, op) in ALL_OPS.iter().enumerate() {
            assert_eq!(*op as usize, i + 1, "{op:?}");
        }
    }
}
