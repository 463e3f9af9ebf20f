//! What a GPU hash join knows of its join ([`JoinWork`]: keys, output columns, the residual
//! filter and the rows each join type emits), and matching on the host for what the device
//! cannot take.

use super::*;

/// What a `GpuHashJoinExec` needs to know of its join.
#[derive(Debug)]
pub struct JoinWork {
    pub(super) left_keys: Vec<usize>,
    pub(super) right_keys: Vec<usize>,
    pub(super) join_type: JoinType,
    pub(super) mode: PartitionMode,
    pub(super) null_equals_null: bool,
    pub(super) filter: Option<JoinFilter>,
    pub(super) projection: Option<Vec<usize>>,
    pub(super) left_columns: usize,
    pub(super) left_schema: SchemaRef,
    pub(super) right_schema: SchemaRef,
    pub(super) schema: SchemaRef,
}

pub(super) fn key_columns(
    exprs: impl Iterator<Item = Arc<dyn PhysicalExpr>>,
    schema: &SchemaRef,
) -> Result<(Vec<usize>, Vec<DataType>), Reason> {
    let mut columns = Vec::new();
    let mut types = Vec::new();
    for e in exprs {
        let Some(c) = e.downcast_ref::<Column>() else {
            return Err(format!("join key {e} is not a column"));
        };
        let t = schema.field(c.index()).data_type();
        let device = fulmen_kernels::column::device_type(t, 0)
            .map_err(|_| format!("join keys of type {t} are not supported on GPU"))?;
        if !crate::physical_plan::keyable(&device) {
            return Err(format!("{device} join keys are not supported on GPU"));
        }
        columns.push(c.index());
        types.push(device);
    }
    Ok((columns, types))
}

impl JoinWork {
    /// The join's work, or why it stays on the CPU.
    pub fn plan(plan: &Arc<dyn ExecutionPlan>) -> Result<Self, Reason> {
        let Some(join) = plan.downcast_ref::<HashJoinExec>() else {
            return Err("not a HashJoinExec".into());
        };
        let join_type = *join.join_type();
        if matches!(join_type, JoinType::LeftMark | JoinType::RightMark) {
            return Err(format!("{join_type} joins are not supported on GPU"));
        }
        if join.null_aware {
            return Err("null-aware anti joins (NOT IN) are not supported on GPU".into());
        }
        if join.fetch().is_some() {
            return Err("a join with a row limit is not supported on GPU".into());
        }
        let mode = *join.partition_mode();
        match mode {
            PartitionMode::Partitioned => {}
            PartitionMode::CollectLeft
                if join.left().output_partitioning().partition_count() == 1 => {}
            _ => return Err(format!("partition mode {mode:?} is not supported on GPU")),
        }
        let left_schema = join.left().schema();
        let right_schema = join.right().schema();
        let (left_keys, left_types) =
            key_columns(join.on().iter().map(|(l, _)| Arc::clone(l)), &left_schema)?;
        let (right_keys, right_types) =
            key_columns(join.on().iter().map(|(_, r)| Arc::clone(r)), &right_schema)?;
        if left_types != right_types {
            return Err(format!(
                "join keys of different types ({left_types:?} and {right_types:?})"
            ));
        }
        Ok(Self {
            left_keys,
            right_keys,
            join_type,
            mode,
            null_equals_null: join.null_equality() == NullEquality::NullEqualsNull,
            filter: join.filter().cloned(),
            projection: join.projection.as_ref().map(|p| p.to_vec()),
            left_columns: left_schema.fields().len(),
            left_schema,
            right_schema,
            schema: plan.schema(),
        })
    }

    /// Whether the output can stay on the device for a GPU parent: an inner join without
    /// a residual filter (the others still assemble their output on the host).
    pub(super) fn device_output(&self) -> bool {
        self.join_type == JoinType::Inner && self.filter.is_none()
    }

    /// Whether the join emits only build rows, chosen by the probe (left semi and left
    /// anti joins without a residual filter): a build side on the device stays there, the
    /// probe marks the rows it matched, and only the rows emitted are gathered there at the
    /// end (see `semi.rs`).
    pub(super) fn build_rows_on_device(&self) -> bool {
        self.marks_matches()
    }

    /// Whether the probe marks the build rows it matched in a bitmap on the device, with
    /// no host wait, instead of bringing pairs down (`marks.rs`), wherever the build side
    /// lies: the joins that emit only build rows, chosen by the probe (left semi and left
    /// anti joins without a residual filter).
    pub(super) fn marks_matches(&self) -> bool {
        matches!(self.join_type, JoinType::LeftSemi | JoinType::LeftAnti) && self.filter.is_none()
    }

    /// Whether an inner join whose output goes to the host, over probe rows already on the
    /// device, should match and gather there and bring down only its output: when that
    /// output is narrower per probe row than what matching on the host moves (the probe
    /// child's every column down, its keys up and a pair of row numbers down), counting
    /// one match per probe row (the foreign-key joins these are) and strings at a nominal
    /// width. A build side whose columns are wide is cheaper to take from on the host.
    pub(super) fn output_narrower_on_device(&self) -> bool {
        let probe_columns: usize = (self.right_schema.fields().iter())
            .map(|f| row_bytes(f.data_type()))
            .sum();
        let keys: usize = (self.right_keys.iter())
            .map(|&c| row_bytes(self.right_schema.field(c).data_type()))
            .sum();
        let output: usize = (self.output_sources().into_iter())
            .map(|(from_build, c)| {
                let schema = if from_build {
                    &self.left_schema
                } else {
                    &self.right_schema
                };
                row_bytes(schema.field(c).data_type())
            })
            .sum();
        output < probe_columns + keys + 2 * 4
    }

    /// The probe columns an inner join outputs, each once, in order.
    pub(super) fn probe_outputs(&self) -> Vec<usize> {
        let mut columns: Vec<usize> = (self.output_sources().into_iter())
            .filter_map(|(from_build, c)| (!from_build).then_some(c))
            .collect();
        columns.sort_unstable();
        columns.dedup();
        columns
    }

    /// Where each output column of an inner join (or a left semi or anti join, whose
    /// columns are the build side's) comes from: (build side?, column).
    pub(super) fn output_sources(&self) -> Vec<(bool, usize)> {
        let all = match self.join_type {
            JoinType::LeftSemi | JoinType::LeftAnti => self.left_columns,
            _ => self.left_columns + self.right_schema.fields().len(),
        };
        let columns: Vec<usize> = match &self.projection {
            Some(p) => p.clone(),
            None => (0..all).collect(),
        };
        columns
            .into_iter()
            .map(|c| {
                if c < self.left_columns {
                    (true, c)
                } else {
                    (false, c - self.left_columns)
                }
            })
            .collect()
    }

    /// Whether build rows are emitted at the end (never matched, or matched).
    pub(super) fn emits_build_rows(&self) -> bool {
        matches!(
            self.join_type,
            JoinType::Left | JoinType::Full | JoinType::LeftSemi | JoinType::LeftAnti
        )
    }

    /// The output of pairs (`None` on a side: that side is NULL) in join order, projected.
    pub(super) fn output(
        &self,
        build: &RecordBatch,
        probe: Option<&RecordBatch>,
        build_rows: &UInt32Array,
        probe_rows: &UInt32Array,
    ) -> Result<RecordBatch> {
        let n = match self.join_type {
            JoinType::RightSemi | JoinType::RightAnti => probe_rows.len(),
            _ => build_rows.len(),
        };
        let take_all = |batch: &RecordBatch, rows: &UInt32Array| -> Result<Vec<ArrayRef>> {
            batch
                .columns()
                .iter()
                .map(|c| take(c.as_ref(), rows, None).map_err(arrow_err))
                .collect()
        };
        let nulls = |schema: &SchemaRef| -> Vec<ArrayRef> {
            schema
                .fields()
                .iter()
                .map(|f| datafusion::arrow::array::new_null_array(f.data_type(), n))
                .collect()
        };
        let columns: Vec<ArrayRef> = match self.join_type {
            JoinType::LeftSemi | JoinType::LeftAnti => take_all(build, build_rows)?,
            JoinType::RightSemi | JoinType::RightAnti => match probe {
                Some(p) => take_all(p, probe_rows)?,
                None => nulls(&self.right_schema),
            },
            _ => {
                let mut columns = take_all(build, build_rows)?;
                columns.extend(match probe {
                    Some(p) => take_all(p, probe_rows)?,
                    None => nulls(&self.right_schema),
                });
                columns
            }
        };
        let columns = match &self.projection {
            Some(p) => p.iter().map(|&i| Arc::clone(&columns[i])).collect(),
            None => columns,
        };
        self.batch_of(columns, n)
    }

    /// An inner join's output over matched pairs: each output column (see
    /// [`output_sources`](Self::output_sources)) taken from `column(from_build, c)`, the
    /// host rows of that side's column `c`, at the build or probe rows.
    pub(super) fn inner_output(
        &self,
        column: impl Fn(bool, usize) -> Option<ArrayRef>,
        build_rows: &UInt32Array,
        probe_rows: &UInt32Array,
    ) -> Result<RecordBatch> {
        let columns = (self.output_sources().into_iter())
            .map(|(from_build, c)| {
                let array = column(from_build, c)
                    .ok_or_else(|| internal_datafusion_err!("join output column {c} is missing"))?;
                let rows = if from_build { build_rows } else { probe_rows };
                take(array.as_ref(), rows, None).map_err(arrow_err)
            })
            .collect::<Result<Vec<_>>>()?;
        self.batch_of(columns, build_rows.len())
    }

    /// The output batch of `columns` (cast to the output's types where they differ), of
    /// `n` rows.
    fn batch_of(&self, columns: Vec<ArrayRef>, n: usize) -> Result<RecordBatch> {
        let columns = columns
            .into_iter()
            .zip(self.schema.fields())
            .map(|(c, f)| {
                if c.data_type() == f.data_type() {
                    Ok(c)
                } else {
                    datafusion::arrow::compute::cast(&c, f.data_type()).map_err(arrow_err)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        RecordBatch::try_new_with_options(
            Arc::clone(&self.schema),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(n)),
        )
        .map_err(arrow_err)
    }

    /// Keeps the pairs the residual filter accepts (evaluated by DataFusion on the host).
    pub(super) fn filter_pairs(
        &self,
        build: &RecordBatch,
        probe: &RecordBatch,
        matches: Matches,
    ) -> Result<Matches> {
        let Some(filter) = &self.filter else {
            return Ok(matches);
        };
        if matches.build.is_empty() {
            return Ok(matches);
        }
        let b = UInt32Array::from(matches.build.clone());
        let p = UInt32Array::from(matches.probe.clone());
        let columns = filter
            .column_indices()
            .iter()
            .map(|ci| {
                let (batch, rows) = match ci.side {
                    JoinSide::Left => (build, &b),
                    _ => (probe, &p),
                };
                take(batch.column(ci.index).as_ref(), rows, None).map_err(arrow_err)
            })
            .collect::<Result<Vec<_>>>()?;
        let intermediate = RecordBatch::try_new_with_options(
            Arc::clone(filter.schema()),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(b.len())),
        )
        .map_err(arrow_err)?;
        let keep = filter
            .expression()
            .evaluate(&intermediate)?
            .into_array(b.len())?;
        let keep = keep
            .as_any()
            .downcast_ref::<BooleanArray>()
            .ok_or_else(|| internal_datafusion_err!("a join filter that is not boolean"))?;
        let mut out = Matches::default();
        for i in 0..keep.len() {
            // A NULL filter result drops the pair, as SQL's ON does.
            if keep.is_valid(i) && keep.value(i) {
                out.build.push(matches.build[i]);
                out.probe.push(matches.probe[i]);
            }
        }
        Ok(out)
    }

    /// The output for one probe batch given its (filtered) matches; marks the build rows
    /// that matched in `visited`.
    pub(super) fn probe_output(
        &self,
        build: &RecordBatch,
        probe: &RecordBatch,
        matches: &Matches,
        visited: &mut [bool],
    ) -> Result<Option<RecordBatch>> {
        for &b in &matches.build {
            visited[b as usize] = true;
        }
        let n = probe.num_rows();
        let matched_probe = || {
            let mut seen = vec![false; n];
            for &p in &matches.probe {
                seen[p as usize] = true;
            }
            seen
        };
        let (build_rows, probe_rows): (UInt32Array, UInt32Array) = match self.join_type {
            JoinType::Inner | JoinType::Left => (
                UInt32Array::from(matches.build.clone()),
                UInt32Array::from(matches.probe.clone()),
            ),
            JoinType::Right | JoinType::Full => {
                // In probe order, an unmatched probe row (left side NULL) where it stands,
                // as DataFusion's (which keeps the probe side's order).
                let mut b: Vec<Option<u32>> = Vec::with_capacity(matches.build.len());
                let mut p: Vec<u32> = Vec::with_capacity(matches.probe.len());
                let mut at = 0;
                for i in 0..n as u32 {
                    let start = at;
                    while at < matches.probe.len() && matches.probe[at] == i {
                        b.push(Some(matches.build[at]));
                        p.push(i);
                        at += 1;
                    }
                    if at == start {
                        b.push(None);
                        p.push(i);
                    }
                }
                (UInt32Array::from(b), UInt32Array::from(p))
            }
            JoinType::RightSemi | JoinType::RightAnti => {
                let want = self.join_type == JoinType::RightSemi;
                let seen = matched_probe();
                let p: Vec<u32> = (0..n as u32)
                    .filter(|&i| seen[i as usize] == want)
                    .collect();
                (UInt32Array::from(Vec::<u32>::new()), UInt32Array::from(p))
            }
            _ => return Ok(None),
        };
        if build_rows.is_empty() && probe_rows.is_empty() {
            return Ok(None);
        }
        if matches!(self.join_type, JoinType::RightSemi | JoinType::RightAnti) {
            return self
                .output(
                    build,
                    Some(probe),
                    &UInt32Array::from(vec![0u32; 0]),
                    &probe_rows,
                )
                .map(Some);
        }
        self.output(build, Some(probe), &build_rows, &probe_rows)
            .map(Some)
    }

    /// The build rows emitted once probing is over.
    pub(super) fn final_output(
        &self,
        build: &RecordBatch,
        visited: &[bool],
    ) -> Result<Option<RecordBatch>> {
        let want_matched = self.join_type == JoinType::LeftSemi;
        let rows: Vec<u32> = (0..visited.len() as u32)
            .filter(|&i| visited[i as usize] == want_matched)
            .collect();
        if rows.is_empty() {
            return Ok(None);
        }
        let rows = UInt32Array::from(rows);
        self.output(build, None, &rows, &UInt32Array::from(Vec::<u32>::new()))
            .map(Some)
    }
}

pub(super) fn arrow_err(e: datafusion::arrow::error::ArrowError) -> DataFusionError {
    DataFusionError::ArrowError(Box::new(e), None)
}

/// The rows whose keys can match: every key non-NULL (or all rows, when NULL equals NULL).
pub(super) fn key_validity(columns: &[ArrayRef], null_equals_null: bool) -> Option<Vec<bool>> {
    if null_equals_null || columns.iter().all(|c| c.null_count() == 0) {
        return None;
    }
    let n = columns.first().map_or(0, |c| c.len());
    Some(
        (0..n)
            .map(|i| columns.iter().all(|c| c.is_valid(i)))
            .collect(),
    )
}

pub(super) fn upload_validity(
    device: &Device,
    valid: &Option<Vec<bool>>,
) -> Result<Option<DeviceBuffer>, KernelError> {
    let Some(valid) = valid else {
        return Ok(None);
    };
    let mut bytes = vec![0u8; valid.len().div_ceil(8)];
    for (i, &v) in valid.iter().enumerate() {
        if v {
            bytes[i / 8] |= 1 << (i % 8);
        }
    }
    device.upload(&bytes).map(Some)
}

/// Matching on the host, for batches (or partitions) the device could not take: the
/// same pairs in the same order as the device's.
pub(super) struct HostIndex {
    pub(super) converter: RowConverter,
    pub(super) rows: HashMap<Vec<u8>, Vec<u32>>,
}

/// Float keys with -0.0 made 0.0 (the row format tells the two apart; joins do not).
pub(super) fn canonical_keys(keys: &[ArrayRef]) -> Result<Vec<ArrayRef>> {
    keys.iter()
        .map(|k| {
            crate::physical_plan::gpu_aggregate::canonical_zeros(Arc::clone(k)).map_err(arrow_err)
        })
        .collect()
}

impl HostIndex {
    pub(super) fn new(keys: &[ArrayRef], null_equals_null: bool) -> Result<Self> {
        let keys = &canonical_keys(keys)?;
        let converter = RowConverter::new(
            keys.iter()
                .map(|k| SortField::new(k.data_type().clone()))
                .collect(),
        )?;
        let converted = converter.convert_columns(keys)?;
        let valid = key_validity(keys, null_equals_null);
        let mut rows: HashMap<Vec<u8>, Vec<u32>> = HashMap::new();
        for i in 0..converted.num_rows() {
            if valid.as_ref().is_none_or(|v| v[i]) {
                rows.entry(converted.row(i).as_ref().to_vec())
                    .or_default()
                    .push(i as u32);
            }
        }
        Ok(Self { converter, rows })
    }

    pub(super) fn probe(&self, keys: &[ArrayRef], null_equals_null: bool) -> Result<Matches> {
        let keys = &canonical_keys(keys)?;
        let converted = self.converter.convert_columns(keys)?;
        let valid = key_validity(keys, null_equals_null);
        let mut out = Matches::default();
        for i in 0..converted.num_rows() {
            if valid.as_ref().is_some_and(|v| !v[i]) {
                continue;
            }
            if let Some(builds) = self.rows.get(converted.row(i).as_ref()) {
                for &b in builds {
                    out.build.push(b);
                    out.probe.push(i as u32);
                }
            }
        }
        Ok(out)
    }
}

/// The matches of a probe batch found on the host (the index is built on first use).
pub(super) fn host_matches(
    host: &mut Option<HostIndex>,
    work: &JoinWork,
    build: &RecordBatch,
    probe: &RecordBatch,
) -> Result<Matches> {
    let columns = |batch: &RecordBatch, keys: &[usize]| -> Vec<ArrayRef> {
        keys.iter().map(|&c| Arc::clone(batch.column(c))).collect()
    };
    let index = match host {
        Some(index) => index,
        None => host.insert(HostIndex::new(
            &columns(build, &work.left_keys),
            work.null_equals_null,
        )?),
    };
    index.probe(&columns(probe, &work.right_keys), work.null_equals_null)
}

/// The bytes a value of `data_type` takes on the device (a string: a nominal 20 bytes and
/// its offset; a boolean: one).
pub(super) fn row_bytes(data_type: &DataType) -> usize {
    use fulmen_kernels::column::{Layout, device_type, layout_of};
    match device_type(data_type, 0).ok().as_ref().and_then(layout_of) {
        Some(Layout::Fixed(width)) => width,
        Some(Layout::Bits) => 1,
        Some(Layout::Var(offset)) => 20 + offset,
        Some(Layout::Dict) => 4,
        None => 24,
    }
}
