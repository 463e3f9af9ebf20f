//! Compiles DataFusion physical expressions into one device [`Program`]
//! (`fulmen_kernels::ops::expr`), or says why it cannot: an unsupported expression is a
//! reason, never an approximation.
//!
//! Values on the device are computed with DataFusion's semantics for every row the
//! program handles; cases whose outcome DataFusion defines by wrapping or by an error
//! (integer overflow, division by zero, casts out of range) make the kernel hand the whole
//! batch back to the CPU, which then answers exactly as DataFusion does.

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::{DataType, Schema, TimeUnit};
use datafusion::common::ScalarValue;
use datafusion::logical_expr::ColumnarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, CastExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, LikeExpr,
    Literal, NegativeExpr, NotExpr,
};
use datafusion::physical_expr::scalar_subquery::ScalarSubqueryExpr;
use datafusion::physical_plan::PhysicalExpr;
use fulmen_kernels::column::NARROW_DECIMAL_PRECISION;
use fulmen_kernels::ops::expr::{
    CMP_NULL_SAFE, Cmp, IntKind, MAX_OUTPUTS, MAX_STACK, Op, OutKind, Program,
};

/// Why an expression cannot run on a GPU.
pub type Reason = String;

/// A compiled program and the batch columns its load slots read, in slot order.
#[derive(Debug, Clone)]
pub struct CompiledExprs {
    /// The device program; output i is expression i.
    pub program: Program,
    /// Batch column index of each load slot.
    pub inputs: Vec<usize>,
    /// Constants known only when a batch runs (scalar subqueries): the constant's index
    /// and the expression that gives it.
    pub runtime_constants: Vec<(i64, Arc<dyn PhysicalExpr>)>,
}

impl CompiledExprs {
    /// The program with its runtime constants filled in for `batch`, or why not (the
    /// batch then runs on the CPU).
    pub fn bind(&self, batch: &RecordBatch) -> Result<std::borrow::Cow<'_, Program>, Reason> {
        if self.runtime_constants.is_empty() {
            return Ok(std::borrow::Cow::Borrowed(&self.program));
        }
        let mut program = self.program.clone();
        for (k, expr) in &self.runtime_constants {
            let value = match expr.evaluate(batch).map_err(|e| e.to_string())? {
                ColumnarValue::Scalar(v) => v,
                ColumnarValue::Array(_) => return Err(format!("{expr} gave a column")),
            };
            let words = scalar_words(&value).ok_or_else(|| format!("value {value}"))?;
            program.set_constant(*k, words);
        }
        Ok(std::borrow::Cow::Owned(program))
    }
}

/// A scalar as the kernel's constant words: `Some(None)` for NULL, `None` when the program
/// cannot hold it (strings go through `Program::string_constant`).
fn scalar_words(value: &ScalarValue) -> Option<Option<(i64, i64)>> {
    use ScalarValue::*;
    if value.is_null() {
        return Some(None);
    }
    Some(Some(match value {
        Int8(Some(v)) => (*v as i64, 0),
        Int16(Some(v)) => (*v as i64, 0),
        Int32(Some(v)) | Date32(Some(v)) => (*v as i64, 0),
        Int64(Some(v)) => (*v, 0),
        UInt8(Some(v)) => (*v as i64, 0),
        UInt16(Some(v)) => (*v as i64, 0),
        UInt32(Some(v)) => (*v as i64, 0),
        Boolean(Some(v)) => (*v as i64, 0),
        Float32(Some(v)) => ((*v as f64).to_bits() as i64, 0),
        Float64(Some(v)) => (v.to_bits() as i64, 0),
        Decimal128(Some(v), _, _) => (*v as u128 as u64 as i64, (*v >> 64) as i64),
        TimestampSecond(Some(v), _)
        | TimestampMillisecond(Some(v), _)
        | TimestampMicrosecond(Some(v), _)
        | TimestampNanosecond(Some(v), _) => (*v, 0),
        _ => return None,
    }))
}

/// How values of a type live in the program's registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Int(IntKind),
    Float { f32: bool },
    Decimal { precision: u8, scale: i8 },
    Bool,
    Str { large: bool },
    Date,
    Timestamp(TimeUnit, bool),
    Null,
}

fn class_of(data_type: &DataType) -> Option<Class> {
    use DataType::*;
    Some(match data_type {
        Int8 => Class::Int(IntKind::I8),
        Int16 => Class::Int(IntKind::I16),
        Int32 => Class::Int(IntKind::I32),
        Int64 => Class::Int(IntKind::I64),
        UInt8 => Class::Int(IntKind::U8),
        UInt16 => Class::Int(IntKind::U16),
        UInt32 => Class::Int(IntKind::U32),
        Float32 => Class::Float { f32: true },
        Float64 => Class::Float { f32: false },
        Decimal128(p, s) if *s >= 0 => Class::Decimal {
            precision: *p,
            scale: *s,
        },
        Boolean => Class::Bool,
        Utf8 | Utf8View => Class::Str { large: false },
        LargeUtf8 => Class::Str { large: true },
        Date32 => Class::Date,
        Timestamp(unit, tz) => Class::Timestamp(*unit, tz.is_some()),
        Null => Class::Null,
        _ => return None,
    })
}

/// Where each class's values compare: integers (incl. dates, timestamps, booleans) as
/// i64, floats in total order, decimals as i128 at one scale, strings bytewise.
fn comparison_op(class: Class) -> Option<Op> {
    Some(match class {
        Class::Int(_) | Class::Bool | Class::Date | Class::Timestamp(..) => Op::CmpI,
        Class::Float { .. } => Op::CmpF,
        Class::Decimal { .. } => Op::CmpD,
        Class::Str { .. } => Op::CmpS,
        Class::Null => return None,
    })
}

fn units_per_second(unit: TimeUnit) -> i64 {
    match unit {
        TimeUnit::Second => 1,
        TimeUnit::Millisecond => 1_000,
        TimeUnit::Microsecond => 1_000_000,
        TimeUnit::Nanosecond => 1_000_000_000,
    }
}

/// The output kind of a value of this type, if the program can write it.
fn out_kind(data_type: &DataType) -> Option<OutKind> {
    Some(match class_of(data_type)? {
        Class::Int(k) => match k {
            IntKind::I8 => OutKind::I8,
            IntKind::I16 => OutKind::I16,
            IntKind::I32 => OutKind::I32,
            IntKind::I64 => OutKind::I64,
            IntKind::U8 => OutKind::U8,
            IntKind::U16 => OutKind::U16,
            IntKind::U32 => OutKind::U32,
        },
        Class::Float { f32: true } => OutKind::F32,
        Class::Float { f32: false } => OutKind::F64,
        Class::Decimal { precision, .. } if precision <= NARROW_DECIMAL_PRECISION => {
            OutKind::Decimal64
        }
        Class::Decimal { .. } => OutKind::Decimal,
        Class::Bool => OutKind::Bool,
        Class::Date => OutKind::I32,
        Class::Timestamp(..) => OutKind::I64,
        Class::Str { .. } | Class::Null => return None,
    })
}

/// Whether a value of this type can be an output of a program (strings cannot yet).
pub fn is_output_type(data_type: &DataType) -> bool {
    out_kind(data_type).is_some()
}

/// Compiles `exprs` over rows of `schema` into one program with an output per expression.
pub fn compile(exprs: &[Arc<dyn PhysicalExpr>], schema: &Schema) -> Result<CompiledExprs, Reason> {
    compile_with(exprs, schema, false)
}

/// [`compile`] for a program whose outputs stay in registers (a fused aggregation's: its
/// keys, row selection and arguments, `GroupTable::update_fused`), so that an output may
/// also be a string (a key or a counted value): its type is the one a string column has on
/// the device (`Utf8` or `LargeUtf8`), as the table's keys have.
pub fn compile_registers(
    exprs: &[Arc<dyn PhysicalExpr>],
    schema: &Schema,
) -> Result<CompiledExprs, Reason> {
    compile_with(exprs, schema, true)
}

fn compile_with(
    exprs: &[Arc<dyn PhysicalExpr>],
    schema: &Schema,
    registers: bool,
) -> Result<CompiledExprs, Reason> {
    if exprs.len() > MAX_OUTPUTS {
        return Err(format!(
            "more than {MAX_OUTPUTS} computed columns in one operator"
        ));
    }
    let mut compiler = Compiler {
        schema,
        program: Program::new(),
        inputs: Vec::new(),
        runtime_constants: Vec::new(),
    };
    for expr in exprs {
        let data_type = expr.data_type(schema).map_err(|e| e.to_string())?;
        let (kind, data_type) = match (out_kind(&data_type), class_of(&data_type)) {
            (Some(kind), _) => (kind, data_type),
            (None, Some(Class::Str { large })) if registers => {
                let on_device = if large {
                    DataType::LargeUtf8
                } else {
                    DataType::Utf8
                };
                (OutKind::Str, on_device)
            }
            _ => {
                return Err(format!(
                    "results of type {data_type} are not supported on GPU"
                ));
            }
        };
        let class = compiler.expr(expr)?;
        compiler.expect(class, &data_type, expr)?;
        compiler.program.output(kind, data_type);
    }
    if compiler.program.max_depth() > MAX_STACK {
        return Err(format!(
            "expression nests deeper than the GPU interpreter's {MAX_STACK} values"
        ));
    }
    Ok(CompiledExprs {
        program: compiler.program,
        inputs: compiler.inputs,
        runtime_constants: compiler.runtime_constants,
    })
}

struct Compiler<'a> {
    schema: &'a Schema,
    program: Program,
    inputs: Vec<usize>,
    runtime_constants: Vec<(i64, Arc<dyn PhysicalExpr>)>,
}

fn unsupported<T>(what: impl std::fmt::Display) -> Result<T, Reason> {
    Err(format!("{what} is not supported on GPU"))
}

impl Compiler<'_> {
    /// Emits an op (the program tracks its stack depth).
    fn emit(&mut self, op: Op, aux: i64, arg: i64) {
        self.program.push(op, aux, arg);
    }

    /// Checks that a compiled value has the representation `data_type` expects.
    fn expect(
        &self,
        class: Class,
        data_type: &DataType,
        expr: &Arc<dyn PhysicalExpr>,
    ) -> Result<(), Reason> {
        let want = class_of(data_type)
            .ok_or_else(|| format!("values of type {data_type} are not supported on GPU"))?;
        let same = match (class, want) {
            (Class::Null, _) => true,
            (Class::Int(_), Class::Int(_)) => true,
            (Class::Decimal { scale: a, .. }, Class::Decimal { scale: b, .. }) => a == b,
            (Class::Str { .. }, Class::Str { .. }) => true,
            (a, b) => a == b,
        };
        if same {
            Ok(())
        } else {
            Err(format!(
                "{expr} computes {class:?} where {data_type} is expected; not supported on GPU"
            ))
        }
    }

    fn expr(&mut self, expr: &Arc<dyn PhysicalExpr>) -> Result<Class, Reason> {
        let any = expr.as_ref();
        if let Some(column) = any.downcast_ref::<Column>() {
            return self.column(column);
        }
        if let Some(literal) = any.downcast_ref::<Literal>() {
            return self.literal(literal.value());
        }
        if let Some(binary) = any.downcast_ref::<BinaryExpr>() {
            return self.binary(binary, expr);
        }
        if let Some(not) = any.downcast_ref::<NotExpr>() {
            let class = self.expr(not.arg())?;
            if !matches!(class, Class::Bool | Class::Null) {
                return unsupported(format!("NOT of {class:?}"));
            }
            self.emit(Op::Not, 0, 0);
            return Ok(Class::Bool);
        }
        if let Some(is_null) = any.downcast_ref::<IsNullExpr>() {
            self.expr(is_null.arg())?;
            self.emit(Op::IsNull, 0, 0);
            return Ok(Class::Bool);
        }
        if let Some(is_not_null) = any.downcast_ref::<IsNotNullExpr>() {
            self.expr(is_not_null.arg())?;
            self.emit(Op::IsNotNull, 0, 0);
            return Ok(Class::Bool);
        }
        if let Some(negative) = any.downcast_ref::<NegativeExpr>() {
            let class = self.expr(negative.arg())?;
            match class {
                Class::Int(k) => self.emit(Op::NegI, k as i64, 0),
                Class::Float { .. } => self.emit(Op::NegF, 0, 0),
                Class::Decimal { .. } => self.emit(Op::NegD, 0, 0),
                other => return unsupported(format!("negation of {other:?}")),
            }
            return Ok(class);
        }
        if let Some(case) = any.downcast_ref::<CaseExpr>() {
            return self.case(case, expr);
        }
        if let Some(in_list) = any.downcast_ref::<InListExpr>() {
            return self.in_list(in_list);
        }
        if let Some(cast) = any.downcast_ref::<CastExpr>() {
            if cast.cast_options().safe {
                return unsupported("TRY_CAST");
            }
            return self.cast(cast.expr(), cast.cast_type());
        }
        if let Some(like) = any.downcast_ref::<LikeExpr>() {
            return self.like(like);
        }
        if let Some(function) = any.downcast_ref::<ScalarFunctionExpr>() {
            return self.function(function);
        }
        if any.downcast_ref::<ScalarSubqueryExpr>().is_some() {
            // One value for the whole query, known once the subquery has run: a constant
            // filled in per batch.
            let data_type = expr.data_type(self.schema).map_err(|e| e.to_string())?;
            let class = class_of(&data_type).filter(|c| !matches!(c, Class::Str { .. }));
            let Some(class) = class else {
                return unsupported(format!("a scalar subquery of type {data_type}"));
            };
            let k = self.program.constant(None);
            self.runtime_constants.push((k, Arc::clone(expr)));
            self.emit(Op::Const, 0, k);
            return Ok(class);
        }
        unsupported(expr_name(expr))
    }

    fn column(&mut self, column: &Column) -> Result<Class, Reason> {
        let field = self
            .schema
            .fields()
            .get(column.index())
            .ok_or_else(|| format!("column {column} is outside the input"))?;
        let data_type = field.data_type();
        let class = class_of(data_type).ok_or_else(|| {
            format!(
                "column {} of type {data_type} is not supported on GPU",
                field.name()
            )
        })?;
        let op = match class {
            Class::Int(k) => match k {
                IntKind::I8 => Op::LoadI8,
                IntKind::I16 => Op::LoadI16,
                IntKind::I32 => Op::LoadI32,
                IntKind::I64 => Op::LoadI64,
                IntKind::U8 => Op::LoadU8,
                IntKind::U16 => Op::LoadU16,
                IntKind::U32 => Op::LoadU32,
            },
            Class::Float { f32: true } => Op::LoadF32,
            Class::Float { f32: false } => Op::LoadF64,
            Class::Decimal { precision, .. } if precision <= NARROW_DECIMAL_PRECISION => {
                Op::LoadDec64
            }
            Class::Decimal { .. } => Op::LoadDec,
            Class::Bool => Op::LoadBool,
            Class::Str { large: false } => Op::LoadStr32,
            Class::Str { large: true } => Op::LoadStr64,
            Class::Date => Op::LoadI32,
            Class::Timestamp(..) => Op::LoadI64,
            Class::Null => {
                self.emit(Op::Null, 0, 0);
                return Ok(Class::Null);
            }
        };
        let slot = match self.inputs.iter().position(|&i| i == column.index()) {
            Some(slot) => slot,
            None => {
                self.inputs.push(column.index());
                self.inputs.len() - 1
            }
        };
        self.emit(op, 0, slot as i64);
        Ok(class)
    }

    fn literal(&mut self, value: &ScalarValue) -> Result<Class, Reason> {
        use ScalarValue::*;
        let class = class_of(&value.data_type()).ok_or_else(|| {
            format!(
                "literals of type {} are not supported on GPU",
                value.data_type()
            )
        })?;
        if value.is_null() {
            self.emit(Op::Null, 0, 0);
            return Ok(class);
        }
        if let Utf8(Some(s)) | LargeUtf8(Some(s)) | Utf8View(Some(s)) = value {
            let k = self.program.string_constant(s.as_bytes());
            self.emit(Op::StrConst, 0, k);
            return Ok(class);
        }
        let Some(Some(words)) = scalar_words(value) else {
            return unsupported(format!("literal {value}"));
        };
        let k = self.program.constant(Some(words));
        self.emit(Op::Const, 0, k);
        Ok(class)
    }

    fn binary(
        &mut self,
        binary: &BinaryExpr,
        expr: &Arc<dyn PhysicalExpr>,
    ) -> Result<Class, Reason> {
        use Operator::*;
        let op = *binary.op();
        match op {
            And | Or => {
                for side in [binary.left(), binary.right()] {
                    let class = self.expr(side)?;
                    if !matches!(class, Class::Bool | Class::Null) {
                        return unsupported(format!("{op} of {class:?}"));
                    }
                }
                self.emit(if op == And { Op::And } else { Op::Or }, 0, 0);
                Ok(Class::Bool)
            }
            Eq | NotEq | Lt | LtEq | Gt | GtEq | IsDistinctFrom | IsNotDistinctFrom => {
                let cmp = match op {
                    Eq => Cmp::Eq as i64,
                    NotEq => Cmp::Ne as i64,
                    Lt => Cmp::Lt as i64,
                    LtEq => Cmp::Le as i64,
                    Gt => Cmp::Gt as i64,
                    GtEq => Cmp::Ge as i64,
                    IsNotDistinctFrom => Cmp::Eq as i64 | CMP_NULL_SAFE,
                    _ => Cmp::Ne as i64 | CMP_NULL_SAFE,
                };
                self.comparison(binary.left(), binary.right(), cmp)
            }
            Plus | Minus | Multiply | Divide | Modulo => {
                let schema = self.schema;
                let result = expr.data_type(schema).map_err(|e| e.to_string())?;
                let left_type = binary.left().data_type(schema).map_err(|e| e.to_string())?;
                let right_type = binary
                    .right()
                    .data_type(schema)
                    .map_err(|e| e.to_string())?;
                let (Some(out), Some(l), Some(r)) = (
                    class_of(&result),
                    class_of(&left_type),
                    class_of(&right_type),
                ) else {
                    return unsupported(format!("{left_type} {op} {right_type}"));
                };
                match (out, l, r) {
                    (Class::Int(k), Class::Int(_), Class::Int(_)) => {
                        self.expr(binary.left())?;
                        self.expr(binary.right())?;
                        let code = match op {
                            Plus => Op::AddI,
                            Minus => Op::SubI,
                            Multiply => Op::MulI,
                            Divide => Op::DivI,
                            _ => Op::ModI,
                        };
                        self.emit(code, k as i64, 0);
                    }
                    (Class::Float { f32 }, Class::Float { .. }, Class::Float { .. }) => {
                        self.expr(binary.left())?;
                        self.expr(binary.right())?;
                        let code = match op {
                            Plus => Op::AddF,
                            Minus => Op::SubF,
                            Multiply => Op::MulF,
                            Divide => Op::DivF,
                            _ => Op::ModF,
                        };
                        self.emit(code, i64::from(f32), 0);
                    }
                    (
                        Class::Decimal { precision, scale },
                        Class::Decimal { scale: ls, .. },
                        Class::Decimal { scale: rs, .. },
                    ) => match op {
                        Plus | Minus if scale == ls.max(rs) => {
                            for (side, s) in [(binary.left(), ls), (binary.right(), rs)] {
                                self.expr(side)?;
                                if s < scale {
                                    self.emit(Op::CastDD, 38, (scale - s) as i64);
                                }
                            }
                            let code = if op == Plus { Op::AddD } else { Op::SubD };
                            self.emit(code, precision as i64, 0);
                        }
                        Multiply if scale as i16 == ls as i16 + rs as i16 => {
                            self.expr(binary.left())?;
                            self.expr(binary.right())?;
                            self.emit(Op::MulD, precision as i64, 0);
                        }
                        // arrow: scale s1 + 4 (at most 38); the dividend is multiplied by
                        // 10^(scale - s1 + s2), or the divisor by its inverse.
                        Divide if scale == (ls + 4).min(38) => {
                            let shift = scale as i64 - ls as i64 + rs as i64;
                            self.expr(binary.left())?;
                            if shift > 0 {
                                self.emit(Op::CastDD, 38, shift);
                            }
                            self.expr(binary.right())?;
                            if shift < 0 {
                                self.emit(Op::CastDD, 38, -shift);
                            }
                            self.emit(Op::DivD, precision as i64, 0);
                        }
                        Modulo if scale == ls.max(rs) => {
                            for (side, s) in [(binary.left(), ls), (binary.right(), rs)] {
                                self.expr(side)?;
                                if s < scale {
                                    self.emit(Op::CastDD, 38, (scale - s) as i64);
                                }
                            }
                            self.emit(Op::ModD, precision as i64, 0);
                        }
                        _ => return unsupported(format!("decimal {op} giving {result}")),
                    },
                    _ => return unsupported(format!("{left_type} {op} {right_type}")),
                }
                Ok(out)
            }
            RegexMatch | RegexIMatch | RegexNotMatch | RegexNotIMatch => {
                unsupported(format!("regexp_like (operator {op})"))
            }
            other => unsupported(format!("operator {other}")),
        }
    }

    fn comparison(
        &mut self,
        left: &Arc<dyn PhysicalExpr>,
        right: &Arc<dyn PhysicalExpr>,
        cmp: i64,
    ) -> Result<Class, Reason> {
        let l = self.expr(left)?;
        let r = self.expr(right)?;
        let class = if l == Class::Null { r } else { l };
        let comparable = match (l, r) {
            (Class::Null, _) | (_, Class::Null) => true,
            (Class::Decimal { scale: a, .. }, Class::Decimal { scale: b, .. }) => a == b,
            (Class::Int(_), Class::Int(_)) | (Class::Str { .. }, Class::Str { .. }) => true,
            (a, b) => a == b,
        };
        let op = comparison_op(class).filter(|_| comparable);
        match op {
            Some(op) => {
                self.emit(op, cmp, 0);
                Ok(Class::Bool)
            }
            None if class == Class::Null => {
                // NULL compared with NULL: the answer does not depend on a type.
                self.emit(Op::CmpI, cmp, 0);
                Ok(Class::Bool)
            }
            None => unsupported(format!("comparing {l:?} with {r:?}")),
        }
    }

    fn case(&mut self, case: &CaseExpr, expr: &Arc<dyn PhysicalExpr>) -> Result<Class, Reason> {
        let result = expr.data_type(self.schema).map_err(|e| e.to_string())?;
        let class = class_of(&result)
            .ok_or_else(|| format!("CASE giving {result} is not supported on GPU"))?;
        // otherwise, then (cond, then, SELECT) for each branch from the last to the first:
        // the first branch that holds wins.
        match case.else_expr() {
            Some(e) => {
                let c = self.expr(e)?;
                self.expect(c, &result, e)?;
            }
            None => self.emit(Op::Null, 0, 0),
        }
        for (when, then) in case.when_then_expr().iter().rev() {
            match case.expr() {
                Some(base) => {
                    self.comparison(base, when, Cmp::Eq as i64)?;
                }
                None => {
                    let c = self.expr(when)?;
                    if !matches!(c, Class::Bool | Class::Null) {
                        return unsupported(format!("CASE WHEN of {c:?}"));
                    }
                }
            }
            let c = self.expr(then)?;
            self.expect(c, &result, then)?;
            self.emit(Op::Select, 0, 0);
        }
        Ok(class)
    }

    fn in_list(&mut self, in_list: &InListExpr) -> Result<Class, Reason> {
        if in_list.list().is_empty() {
            return unsupported("an empty IN list");
        }
        for (i, item) in in_list.list().iter().enumerate() {
            self.comparison(in_list.expr(), item, Cmp::Eq as i64)?;
            if i > 0 {
                self.emit(Op::Or, 0, 0);
            }
        }
        if in_list.negated() {
            self.emit(Op::Not, 0, 0);
        }
        Ok(Class::Bool)
    }

    fn cast(&mut self, input: &Arc<dyn PhysicalExpr>, to: &DataType) -> Result<Class, Reason> {
        let from_type = input.data_type(self.schema).map_err(|e| e.to_string())?;
        let (Some(from), Some(target)) = (class_of(&from_type), class_of(to)) else {
            return unsupported(format!("CAST from {from_type} to {to}"));
        };
        let no = || unsupported(format!("CAST from {from_type} to {to}"));
        self.expr(input)?;
        match (from, target) {
            (Class::Null, _) => {}
            (a, b) if a == b => {}
            (Class::Str { .. }, Class::Str { .. }) => {}
            (Class::Int(_) | Class::Bool, Class::Int(k)) => self.emit(Op::CastII, k as i64, 0),
            (Class::Int(_), Class::Bool) => {
                let zero = self.program.constant(Some((0, 0)));
                self.emit(Op::Const, 0, zero);
                self.emit(Op::CmpI, Cmp::Ne as i64, 0);
            }
            (Class::Int(_), Class::Float { f32 }) => self.emit(Op::CastIF, i64::from(f32), 0),
            (Class::Float { .. }, Class::Int(k)) => self.emit(Op::CastFI, k as i64, 0),
            (Class::Float { .. }, Class::Float { f32: true }) => self.emit(Op::CastFF, 1, 0),
            (Class::Float { f32: true }, Class::Float { f32: false }) => {}
            (Class::Int(_), Class::Decimal { precision, scale }) => {
                self.emit(Op::CastID, precision as i64, scale as i64)
            }
            (
                Class::Decimal {
                    scale: from_scale, ..
                },
                Class::Decimal { precision, scale },
            ) if scale >= from_scale => {
                self.emit(Op::CastDD, precision as i64, (scale - from_scale) as i64)
            }
            (Class::Decimal { scale, .. }, Class::Float { f32 }) => {
                self.emit(Op::CastDF, i64::from(f32), scale as i64)
            }
            (Class::Float { .. }, Class::Decimal { precision, scale }) if scale <= 22 => {
                self.emit(Op::CastFD, precision as i64, scale as i64)
            }
            (Class::Date, Class::Timestamp(unit, false)) => {
                self.emit(Op::CastDateTs, 0, 86_400 * units_per_second(unit))
            }
            (Class::Timestamp(unit, false), Class::Date) => {
                self.emit(Op::CastTsDate, 0, 86_400 * units_per_second(unit))
            }
            (Class::Timestamp(from_unit, a), Class::Timestamp(to_unit, b)) if a == b => {
                let (f, t) = (units_per_second(from_unit), units_per_second(to_unit));
                if t < f {
                    // Arrow truncates toward zero here; the kernel floors. Not yet on GPU.
                    return no();
                }
                self.emit(Op::CastTsTs, 0, t / f);
            }
            _ => return no(),
        }
        Ok(target)
    }

    fn like(&mut self, like: &LikeExpr) -> Result<Class, Reason> {
        if like.case_insensitive() {
            return unsupported("ILIKE");
        }
        let pattern = like
            .pattern()
            .downcast_ref::<Literal>()
            .and_then(|l| match l.value() {
                ScalarValue::Utf8(Some(p))
                | ScalarValue::LargeUtf8(Some(p))
                | ScalarValue::Utf8View(Some(p)) => Some(p.clone()),
                _ => None,
            })
            .ok_or_else(|| {
                "LIKE with a pattern that is not a string literal is not supported on GPU"
                    .to_string()
            })?;
        if pattern.contains(['_', '\\']) {
            return unsupported(format!("LIKE '{pattern}' (with _ or an escape)"));
        }
        let class = self.expr(like.expr())?;
        if !matches!(class, Class::Str { .. }) {
            return unsupported(format!("LIKE on {class:?}"));
        }
        let starts = pattern.starts_with('%');
        let ends = pattern.len() > 1 && pattern.ends_with('%') || pattern == "%";
        let core = pattern.trim_start_matches('%').trim_end_matches('%');
        let (op, text) = if core.contains('%') {
            (Some(Op::StrLike), pattern.as_str())
        } else {
            let op = match (starts, ends) {
                (false, false) => None,
                (false, true) => Some(Op::StrPrefix),
                (true, false) => Some(Op::StrSuffix),
                (true, true) => Some(Op::StrContains),
            };
            (op, core)
        };
        let k = self.program.string_constant(text.as_bytes());
        self.emit(Op::StrConst, 0, k);
        match op {
            Some(op) => self.emit(op, 0, 0),
            None => self.emit(Op::CmpS, Cmp::Eq as i64, 0),
        }
        if like.negated() {
            self.emit(Op::Not, 0, 0);
        }
        Ok(Class::Bool)
    }

    fn function(&mut self, function: &ScalarFunctionExpr) -> Result<Class, Reason> {
        let name = function.name();
        let args = function.args();
        let literal_text = |e: &Arc<dyn PhysicalExpr>| {
            e.downcast_ref::<Literal>().and_then(|l| match l.value() {
                ScalarValue::Utf8(Some(p))
                | ScalarValue::LargeUtf8(Some(p))
                | ScalarValue::Utf8View(Some(p)) => Some(p.trim().to_ascii_lowercase()),
                _ => None,
            })
        };
        match (name, args.len()) {
            ("date_part", 2) => {
                let Some(part) = literal_text(&args[0]) else {
                    return unsupported("date_part with a part that is not a literal");
                };
                let code = match part.as_str() {
                    "year" | "years" => 0,
                    "quarter" | "qtr" => 1,
                    "month" | "months" => 2,
                    "day" | "days" => 3,
                    "hour" | "hours" => 4,
                    "minute" | "minutes" => 5,
                    "second" | "seconds" => 6,
                    "doy" => 7,
                    "dow" => 8,
                    other => return unsupported(format!("date_part '{other}'")),
                };
                let arg = match self.expr(&args[1])? {
                    Class::Date => 0,
                    Class::Timestamp(unit, false) => units_per_second(unit),
                    other => return unsupported(format!("date_part of {other:?}")),
                };
                self.emit(Op::DatePart, code, arg);
                self.int_result(function.return_type())
            }
            ("date_trunc", 2) => {
                let Some(granularity) = literal_text(&args[0]) else {
                    return unsupported("date_trunc with a granularity that is not a literal");
                };
                let code = match granularity.as_str() {
                    "year" => 0,
                    "quarter" => 1,
                    "month" => 2,
                    "week" => 3,
                    "day" => 4,
                    "hour" => 5,
                    "minute" => 6,
                    "second" => 7,
                    other => return unsupported(format!("date_trunc '{other}'")),
                };
                let class = self.expr(&args[1])?;
                let Class::Timestamp(unit, false) = class else {
                    return unsupported(format!("date_trunc of {class:?}"));
                };
                if class_of(function.return_type()) != Some(class) {
                    return unsupported(format!("date_trunc giving {}", function.return_type()));
                }
                self.emit(Op::DateTrunc, code, units_per_second(unit));
                Ok(class)
            }
            ("substr", 2 | 3) => {
                let class = self.expr(&args[0])?;
                if !matches!(class, Class::Str { .. }) {
                    return unsupported(format!("substr of {class:?}"));
                }
                for arg in &args[1..] {
                    if !matches!(self.expr(arg)?, Class::Int(_) | Class::Null) {
                        return unsupported("substr with non-integer positions");
                    }
                }
                self.emit(Op::Substr, args.len() as i64, 0);
                Ok(class)
            }
            ("starts_with" | "ends_with" | "contains", 2) => {
                for arg in args {
                    if !matches!(self.expr(arg)?, Class::Str { .. } | Class::Null) {
                        return unsupported(format!("{name} of non-strings"));
                    }
                }
                let op = match name {
                    "starts_with" => Op::StrPrefix,
                    "ends_with" => Op::StrSuffix,
                    _ => Op::StrContains,
                };
                self.emit(op, 0, 0);
                Ok(Class::Bool)
            }
            _ => unsupported(name),
        }
    }

    /// A date part computed as an i64, narrowed to the function's integer result type.
    fn int_result(&mut self, data_type: &DataType) -> Result<Class, Reason> {
        match class_of(data_type) {
            Some(Class::Int(k)) => {
                self.emit(Op::CastII, k as i64, 0);
                Ok(Class::Int(k))
            }
            _ => unsupported(format!("a date part of type {data_type}")),
        }
    }
}

/// A short name for an expression node, for reasons ("regexp_like", "TryCastExpr").
pub fn expr_name(expr: &Arc<dyn PhysicalExpr>) -> String {
    if let Some(f) = expr.downcast_ref::<ScalarFunctionExpr>() {
        return f.name().to_string();
    }
    let text = format!("{expr:?}");
    text.split(|c: char| !c.is_alphanumeric() && c != '_')
        .next()
        .filter(|s| !s.is_empty())
        .unwrap_or("this expression")
        .to_string()
}
