//! The probe side's dynamic filter, filled from the build side's key bounds.

use super::*;

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
        let bounds = key_bounds(build, keys)?;
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
