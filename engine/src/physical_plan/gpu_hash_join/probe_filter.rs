//! The probe side's dynamic filter, filled from the build side's key bounds.

use super::*;
use crate::physical_plan::gpu_aggregate::is_integer_like;

/// The dynamic filter DataFusion's planner attached to the join for its probe side's scan
/// (`DynamicFilter [ empty ]` until filled), filled here as DataFusion's `HashJoinExec`
/// fills its bounds: `key >= min AND key <= max` for every key over the build side's
/// values, once every build partition is in (`false` when no build row can match). In
/// Partitioned mode the ranges are those of all partitions together, which hold for every
/// probe partition. Not attached for joins that keep unmatched probe rows, for
/// `IS NOT DISTINCT FROM` keys (a NULL key matches) and for float keys (-0.0 matches 0.0
/// but sorts below it).
#[derive(Debug)]
pub(super) struct ProbeFilter {
    pub(super) filter: Arc<dyn PhysicalExpr>,
    pub(super) probe_keys: Vec<Arc<dyn PhysicalExpr>>,
    pub(super) builds: usize,
    pub(super) state: Mutex<ProbeFilterState>,
}

#[derive(Debug, Default)]
pub(super) struct ProbeFilterState {
    pub(super) reported: Vec<usize>,
    /// Each key's (min, max) over the build partitions so far; `None` while none has a row
    /// that can match.
    pub(super) bounds: Option<Vec<(ScalarValue, ScalarValue)>>,
    pub(super) done: bool,
}

impl ProbeFilter {
    pub(super) fn plan(join: &HashJoinExec, work: &JoinWork) -> Option<Self> {
        // As DataFusion decides: whether a condition on the probe side may be pushed below
        // the join (not where unmatched probe rows are kept).
        let (_, probe_pushable) = work.join_type.on_lr_is_preserved();
        if !probe_pushable || work.null_equals_null {
            return None;
        }
        let (left_schema, right_schema) = (join.left().schema(), join.right().schema());
        // The bounds are literals of the build key's type, compared with the probe key:
        // both must have one type (DataFusion's coercion gives them one; a Utf8View beside a
        // Utf8 would not compare).
        if join.on().iter().any(|(l, r)| {
            match (l.data_type(&left_schema), r.data_type(&right_schema)) {
                (Ok(t), Ok(u)) => t != u || t.is_floating() || !t.is_primitive() && !is_string(&t),
                _ => true,
            }
        }) {
            return None;
        }
        let filter = join
            .dynamic_expressions_produced()
            .into_iter()
            .find(|e| e.downcast_ref::<DynamicFilterPhysicalExpr>().is_some())?;
        let builds = match work.mode {
            PartitionMode::CollectLeft => 1,
            _ => join.left().output_partitioning().partition_count(),
        };
        Some(Self {
            filter,
            probe_keys: join.on().iter().map(|(_, r)| Arc::clone(r)).collect(),
            builds,
            state: Mutex::default(),
        })
    }

    /// Adds build partition `partition`'s key ranges; the last partition fills the filter.
    pub(super) fn report(
        &self,
        partition: usize,
        build: &RecordBatch,
        keys: &[usize],
    ) -> Result<()> {
        self.report_bounds(partition, key_bounds(build, keys)?)
    }

    /// Adds build partition `partition`'s key ranges, each key's (min, max) (`None`: no
    /// row can match); the last partition fills the filter.
    pub(super) fn report_bounds(
        &self,
        partition: usize,
        bounds: Option<Vec<(ScalarValue, ScalarValue)>>,
    ) -> Result<()> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| internal_datafusion_err!("a poisoned dynamic filter"))?;
        if state.done || state.reported.contains(&partition) {
            return Ok(());
        }
        state.reported.push(partition);
        state.bounds = match (state.bounds.take(), bounds) {
            (None, b) | (b, None) => b,
            (Some(a), Some(b)) => Some(
                a.into_iter()
                    .zip(b)
                    .map(|((lo_a, hi_a), (lo_b, hi_b))| {
                        let lo = if lo_b < lo_a { lo_b } else { lo_a };
                        let hi = if hi_b > hi_a { hi_b } else { hi_a };
                        (lo, hi)
                    })
                    .collect(),
            ),
        };
        if state.reported.len() < self.builds {
            return Ok(());
        }
        state.done = true;
        let predicate = match &state.bounds {
            None => lit(false),
            Some(bounds) => self
                .probe_keys
                .iter()
                .zip(bounds)
                .map(|(key, (lo, hi))| {
                    let at_least: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
                        Arc::clone(key),
                        Operator::GtEq,
                        lit(lo.clone()),
                    ));
                    let at_most: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
                        Arc::clone(key),
                        Operator::LtEq,
                        lit(hi.clone()),
                    ));
                    Arc::new(BinaryExpr::new(at_least, Operator::And, at_most))
                        as Arc<dyn PhysicalExpr>
                })
                .reduce(|a, b| Arc::new(BinaryExpr::new(a, Operator::And, b)))
                .unwrap_or_else(|| lit(true)),
        };
        let dynamic = self
            .filter
            .downcast_ref::<DynamicFilterPhysicalExpr>()
            .ok_or_else(|| internal_datafusion_err!("not a dynamic filter"))?;
        dynamic.update(predicate)?;
        dynamic.mark_complete();
        Ok(())
    }
}

pub(super) fn is_string(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// Each key column's (min, max) over its non-NULL values in `build`; `None` when some key
/// has none (no row of the batch can match then).
pub(super) fn key_bounds(
    build: &RecordBatch,
    keys: &[usize],
) -> Result<Option<Vec<(ScalarValue, ScalarValue)>>> {
    let mut bounds = Vec::with_capacity(keys.len());
    for &k in keys {
        let column = build.column(k);
        let mut lo = MinAccumulator::try_new(column.data_type())?;
        let mut hi = MaxAccumulator::try_new(column.data_type())?;
        lo.update_batch(std::slice::from_ref(column))?;
        hi.update_batch(std::slice::from_ref(column))?;
        let (lo, hi) = (lo.evaluate()?, hi.evaluate()?);
        if lo.is_null() || hi.is_null() {
            return Ok(None);
        }
        bounds.push((lo, hi));
    }
    Ok(Some(bounds))
}

/// Launches a keyless reduction of the build keys' minima and maxima takes on a device, as
/// the emulator counted them: about two per key (the accumulators' starts) and one per
/// chunk (each chunk's update), what [`JoinRun::bounds_pay`] weighs (TPC-H Q21's one key
/// over ten chunks: ten launches more than bringing the keys down).
fn bounds_launches(keys: usize, chunks: usize) -> usize {
    2 * keys + chunks
}

impl JoinRun {
    /// Fills the probe side's dynamic filter from the keys of build rows in `chunks`: their
    /// bounds reduced where they lie when every chunk is on a device, every key is of an
    /// integer-like type and the cost model finds that cheaper than bringing the keys down
    /// ([`bounds_pay`](Self::bounds_pay)); else from the keys brought down. A device error
    /// in the reduction brings the keys down instead; failing to get them only costs the
    /// pruning.
    pub(super) fn report_chunk_keys(&self, partition: usize, chunks: &[Chunk]) {
        let Some(filter) = self.probe_filter.as_deref() else {
            return;
        };
        if self.bounds_pay(chunks) {
            match self.device_bounds(chunks) {
                Ok(bounds) => {
                    if let Err(e) = filter.report_bounds(partition, bounds) {
                        log::warn!("the probe side's dynamic filter stays empty: {e}");
                    }
                    return;
                }
                Err(e) => {
                    if let Err(e) = self.metrics.recover(&e, "bringing the build keys down") {
                        log::warn!("the probe side's dynamic filter stays empty: {e}");
                        return;
                    }
                }
            }
        }
        self.report_keys(partition, self.keys_of(chunks));
    }

    /// Whether the build keys' bounds are reduced on the device: every chunk there, every
    /// key integer-like (the device's integer minimum and maximum), and, in the H200 model,
    /// the reduction's launches costing less than the keys' bytes down (both wait once).
    pub(super) fn bounds_pay(&self, chunks: &[Chunk]) -> bool {
        let schema = self.left.schema();
        let keys = &self.work.left_keys;
        if !(keys.iter()).all(|&k| is_integer_like(schema.field(k).data_type())) {
            return false;
        }
        let mut bytes = 0;
        for chunk in chunks {
            let Chunk::Device(batch, ..) = chunk else {
                return false;
            };
            bytes += (keys.iter())
                .map(|&k| batch.columns()[k].device_bytes())
                .sum::<usize>();
        }
        let model = fulmen_kernels::cost::H200;
        let launches = bounds_launches(keys.len(), chunks.len());
        launches as f64 * model.launch_s < bytes as f64 / model.pcie_bytes_per_s
    }

    /// Each key's (min, max) over its non-NULL values in the device `chunks`, reduced on
    /// the device: one keyless group table per device, updated by each of its chunks and
    /// read in one wait per device; `None` when some key has none (no build row can match).
    fn device_bounds(
        &self,
        chunks: &[Chunk],
    ) -> Result<Option<Vec<(ScalarValue, ScalarValue)>>, KernelError> {
        use fulmen_kernels::ops::aggregate::{AccInput, AccOp, AccState, AccValues, GroupTable};
        let keys = &self.work.left_keys;
        let ops: Vec<AccOp> = (keys.iter())
            .flat_map(|_| [AccOp::MinInt, AccOp::MaxInt])
            .collect();
        let mut tables: Vec<(Device, GroupTable)> = Vec::new();
        for chunk in chunks.iter().filter(|c| c.num_rows() > 0) {
            let Chunk::Device(batch, ..) = chunk else {
                return Err(KernelError::InvalidData("build keys off the device".into()));
            };
            let columns: Vec<&DeviceColumn> = keys.iter().map(|&k| &batch.columns()[k]).collect();
            let inputs: Vec<AccInput<'_>> = (columns.iter())
                .flat_map(|&c| {
                    let input = AccInput {
                        values: Some(c),
                        filter: None,
                    };
                    [input, input]
                })
                .collect();
            let device = columns[0].device();
            let at = match tables.iter().position(|(d, _)| d == device) {
                Some(at) => at,
                None => {
                    tables.push((device.clone(), GroupTable::new(device, &[], &ops)?));
                    tables.len() - 1
                }
            };
            let table = &mut tables[at].1;
            self.metrics
                .kernel(|| table.update(&[], &inputs, batch.num_rows()))?;
        }
        let mut found: Vec<Option<(i64, i64)>> = vec![None; keys.len()];
        let value = |s: &AccState| match &s.values {
            AccValues::Int(v) if s.counts.first().is_some_and(|&c| c > 0) => v.first().copied(),
            _ => None,
        };
        for (_, table) in &tables {
            let states = self.metrics.kernel(|| table.download())?.1;
            if states.len() != ops.len() {
                return Err(KernelError::InvalidData(format!(
                    "{} key bounds read for {} keys",
                    states.len(),
                    keys.len()
                )));
            }
            for (i, pair) in states.chunks_exact(2).enumerate() {
                if let (Some(lo), Some(hi)) = (value(&pair[0]), value(&pair[1])) {
                    found[i] = Some(match found[i] {
                        Some((a, b)) => (a.min(lo), b.max(hi)),
                        None => (lo, hi),
                    });
                }
            }
        }
        let schema = self.left.schema();
        let mut bounds = Vec::with_capacity(keys.len());
        for (&k, range) in keys.iter().zip(found) {
            let Some((lo, hi)) = range else {
                return Ok(None);
            };
            let t = schema.field(k).data_type();
            bounds.push((scalar_of(lo, t)?, scalar_of(hi, t)?));
        }
        Ok(Some(bounds))
    }
}

/// The value of type `t` whose device integer is `v` (narrowed to `t`'s width).
fn scalar_of(v: i64, t: &DataType) -> Result<ScalarValue, KernelError> {
    let bad = |e: String| KernelError::InvalidData(format!("a key bound of type {t}: {e}"));
    let width = t
        .primitive_width()
        .ok_or_else(|| bad("not primitive".into()))?;
    let data = datafusion::arrow::array::ArrayData::builder(t.clone())
        .len(1)
        .add_buffer(datafusion::arrow::buffer::Buffer::from_slice_ref(
            &v.to_le_bytes()[..width],
        ))
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let array = datafusion::arrow::array::make_array(data);
    ScalarValue::try_from_array(&array, 0).map_err(|e| bad(e.to_string()))
}
