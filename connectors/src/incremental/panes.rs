//! `HOP` windows kept as panes. A hopping window of `size` starting every `slide` is the
//! union of the `size / pane` panes it spans, a pane being the `gcd(slide, size)` between
//! two window bounds. So an incremental sink keeps one partial state per group and pane,
//! built from each row once (not once per window holding it), and finishes a closing
//! window by merging the states of its panes, with DataFusion's own accumulators.
//!
//! A closing window's groups are found without hashing its group columns again: each pane
//! state's other group columns (a card, say) are numbered once, and a (number, window) pair
//! gives the window's group. This applies when the window's bounds reach the aggregation
//! only as its `window_start` / `window_end` group columns ([`bounds_only_grouped`]), and
//! the aggregate keeps every group (no limit).

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, Int64Array, RecordBatch, UInt32Array};
use datafusion::arrow::compute::{cast, concat_batches, take};
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{HashMap, internal_datafusion_err};
use datafusion::error::Result;
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_expr::{GroupsAccumulatorAdapter, PhysicalExpr};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::projection::ProjectionExec;

use super::{Split, window_ends};

/// `HOP` windows whose states are kept per pane (see [`hop_panes`]): the lower plan assigns
/// each row to its one pane. Lengths in nanoseconds.
///
/// [`hop_panes`]: fulmen_engine::streaming::hop_panes
pub(super) struct Panes {
    pub slide: i64,
    pub size: i64,
    pub pane: i64,
    /// The group columns holding `window_start` and `window_end` (a pane's bounds in the
    /// states), and their unit in nanoseconds.
    pub start_column: Option<usize>,
    pub end_column: Option<usize>,
    pub unit: i64,
}

/// At most this many (group, window) slots are numbered in a dense table; beyond, in a map.
const DENSE_SLOTS: usize = 1 << 24;

/// From this many (state, window) pairs on, closing windows are finished on several threads
/// (in tests, from a few on, so that both ways are checked against the batch answers).
const PARALLEL_AT: usize = if cfg!(test) { 64 } else { 200_000 };

/// The windows starting in `[from, to]`, to finish from the states of `batch` (numbered by
/// `key_ids`, lying in the windows starting in `spans`).
#[derive(Clone, Copy)]
struct Part<'a> {
    batch: &'a RecordBatch,
    key_ids: &'a [u32],
    key_count: usize,
    spans: &'a [Option<(i64, i64)>],
    from: i64,
    to: i64,
}

impl Panes {
    /// The first and last start of the windows holding the pane ending at `end` that end
    /// after `after`: the windows start every `slide` in between.
    pub fn windows(&self, end: i64, after: Option<i64>) -> Option<(i64, i64)> {
        let mut first = round_up(end - self.size, self.slide);
        if let Some(after) = after {
            first = first.max(round_up(after - self.size + 1, self.slide));
        }
        let last = (end - self.pane).div_euclid(self.slide) * self.slide;
        (first <= last).then_some((first, last))
    }

    /// Which of the pane states `batch` a window ending in `(after, up_to]` holds, and which a
    /// window ending after `up_to` holds (those are kept).
    pub fn closing_and_open(
        &self,
        batch: &RecordBatch,
        split: &Split,
        after: Option<i64>,
        up_to: i64,
    ) -> Result<(Vec<bool>, Vec<bool>)> {
        let ends = window_ends(batch, split)?;
        Ok(ends
            .iter()
            .map(|end| match end.and_then(|e| self.windows(e, after)) {
                Some((first, last)) => (first + self.size <= up_to, last + self.size > up_to),
                None => (false, false),
            })
            .unzip())
    }

    /// The final aggregate's output for the windows ending in `(after, up_to]`, from the pane
    /// states `states` (those a closing window holds): per group and window, the states of
    /// its panes merged and evaluated.
    pub fn finish(
        &self,
        split: &Split,
        states: &[RecordBatch],
        after: Option<i64>,
        up_to: i64,
    ) -> Result<Vec<RecordBatch>> {
        let schema = split.partial.schema();
        let batch = concat_batches(&schema, states)?;
        let rows = batch.num_rows();
        let group_columns = split.partial.group_expr().expr().len();
        let is_bound = |c: usize| Some(c) == self.start_column || Some(c) == self.end_column;
        let keys: Vec<ArrayRef> = (0..group_columns)
            .filter(|c| !is_bound(*c))
            .map(|c| Arc::clone(batch.column(c)))
            .collect();
        // Each state's other group columns, numbered.
        let (key_ids, key_count) = if keys.is_empty() {
            (vec![0u32; rows], 1)
        } else {
            let fields = keys
                .iter()
                .map(|k| SortField::new(k.data_type().clone()))
                .collect();
            let converted = RowConverter::new(fields)?.convert_columns(&keys)?;
            let mut numbers: HashMap<_, u32> = HashMap::with_capacity(rows);
            let ids = converted
                .iter()
                .map(|row| {
                    let next = numbers.len() as u32;
                    *numbers.entry(row).or_insert(next)
                })
                .collect();
            (ids, numbers.len().max(1))
        };
        // The windows each state lies in, clipped to those closing.
        let ends = window_ends(&batch, split)?;
        let spans: Vec<Option<(i64, i64)>> = ends
            .iter()
            .map(|end| {
                let (first, last) = end.and_then(|e| self.windows(e, after))?;
                let last = last.min((up_to - self.size).div_euclid(self.slide) * self.slide);
                (first <= last).then_some((first, last))
            })
            .collect();
        let earliest = spans.iter().flatten().map(|s| s.0).min().unwrap_or(0);
        let latest = spans.iter().flatten().map(|s| s.1).max().unwrap_or(0);
        let window_count = ((latest - earliest) / self.slide + 1) as usize;
        let entries: i64 = spans
            .iter()
            .flatten()
            .map(|(first, last)| (last - first) / self.slide + 1)
            .sum();
        // A backlog closes many windows at once: they are finished in parts, side by side.
        let parts = if entries as usize >= PARALLEL_AT {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(window_count)
        } else {
            1
        };
        let part = |p: usize| {
            let per = window_count.div_ceil(parts) as i64;
            let from = earliest + p as i64 * per * self.slide;
            let to = (from + (per - 1) * self.slide).min(latest);
            let part = Part {
                batch: &batch,
                key_ids: &key_ids,
                key_count,
                spans: &spans,
                from,
                to,
            };
            self.finish_part(split, part)
        };
        if parts <= 1 {
            return Ok(vec![part(0)?]);
        }
        std::thread::scope(|scope| {
            let running: Vec<_> = (0..parts).map(|p| scope.spawn(move || part(p))).collect();
            running
                .into_iter()
                .map(|r| {
                    r.join()
                        .map_err(|_| internal_datafusion_err!("finishing windows panicked"))?
                })
                .collect()
        })
    }

    /// The final aggregate's output for the windows of `part`.
    fn finish_part(&self, split: &Split, part: Part<'_>) -> Result<RecordBatch> {
        let Part {
            batch,
            key_ids,
            key_count,
            spans,
            from,
            to,
        } = part;
        let group_columns = split.partial.group_expr().expr().len();
        let window_count = ((to - from) / self.slide + 1).max(1) as usize;
        let mut slots = Slots::new(key_count, window_count);
        let (mut first_rows, mut starts) = (Vec::new(), Vec::new());
        let (mut take_rows, mut groups) = (Vec::new(), Vec::new());
        for (row, span) in spans.iter().enumerate() {
            let Some((first, last)) = *span else { continue };
            let mut start = first.max(from);
            while start <= last.min(to) {
                let window = ((start - from) / self.slide) as usize;
                let group = slots.group(key_ids[row] as usize, window, || {
                    first_rows.push(row as u32);
                    starts.push(start);
                });
                take_rows.push(row as u32);
                groups.push(group);
                start += self.slide;
            }
        }
        let group_count = first_rows.len();
        if group_count == 0 {
            // (Some accumulators cannot evaluate no groups.)
            return Ok(RecordBatch::new_empty(split.finish.schema()));
        }
        let first_rows = UInt32Array::from(first_rows);
        let mut columns = Vec::with_capacity(split.finish.schema().fields().len());
        for c in 0..group_columns {
            let shift = match (self.start_column, self.end_column) {
                (Some(s), _) if s == c => Some(0),
                (_, Some(e)) if e == c => Some(self.size),
                _ => None,
            };
            columns.push(match shift {
                Some(shift) => {
                    let values: ArrayRef = Arc::new(Int64Array::from_iter_values(
                        starts.iter().map(|s| (s + shift) / self.unit),
                    ));
                    cast(&values, batch.column(c).data_type())?
                }
                None => take(batch.column(c), &first_rows, None)?,
            });
        }
        let take_rows = UInt32Array::from(take_rows);
        let mut offset = group_columns;
        for aggregate in split.partial.aggr_expr() {
            let width = aggregate.state_fields()?.len();
            let values = batch.columns()[offset..offset + width]
                .iter()
                .map(|c| take(c, &take_rows, None))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            offset += width;
            let mut accumulator = groups_accumulator(aggregate)?;
            accumulator.merge_batch(&values, &groups, group_count)?;
            columns.push(accumulator.evaluate(EmitTo::All)?);
        }
        Ok(RecordBatch::try_new(split.finish.schema(), columns)?)
    }
}

/// Numbers (group, window) pairs in the order they are first seen.
enum Slots {
    Dense {
        windows: usize,
        slots: Vec<u32>,
        count: usize,
    },
    Sparse(HashMap<(usize, usize), usize>),
}

impl Slots {
    fn new(keys: usize, windows: usize) -> Self {
        match keys.checked_mul(windows).filter(|n| *n <= DENSE_SLOTS) {
            Some(n) => Slots::Dense {
                windows,
                slots: vec![u32::MAX; n],
                count: 0,
            },
            None => Slots::Sparse(HashMap::new()),
        }
    }

    /// The number of `(key, window)`; `new_group` is called when it is first seen.
    fn group(&mut self, key: usize, window: usize, new_group: impl FnOnce()) -> usize {
        match self {
            Slots::Dense {
                windows,
                slots,
                count,
            } => {
                let slot = &mut slots[key * *windows + window];
                if *slot == u32::MAX {
                    *slot = *count as u32;
                    *count += 1;
                    new_group();
                }
                *slot as usize
            }
            Slots::Sparse(map) => {
                let next = map.len();
                *map.entry((key, window)).or_insert_with(|| {
                    new_group();
                    next
                })
            }
        }
    }
}

/// An aggregate's accumulator over groups, as DataFusion's hash aggregation makes it.
fn groups_accumulator(
    aggregate: &Arc<AggregateFunctionExpr>,
) -> Result<Box<dyn GroupsAccumulator>> {
    if aggregate.groups_accumulator_supported() {
        aggregate.create_groups_accumulator()
    } else {
        let aggregate = Arc::clone(aggregate);
        Ok(Box::new(GroupsAccumulatorAdapter::new(move || {
            aggregate.create_accumulator()
        })))
    }
}

/// The first multiple of `step` at or after `value`.
fn round_up(value: i64, step: i64) -> i64 {
    value + (step - value.rem_euclid(step)) % step
}

/// Whether the window's bounds reach the aggregation nearest it only as its group columns
/// `window_start` and `window_end`: through `between` (the nodes from the window up to it)
/// by name, unchanged, and used by no expression but those group columns. Then a pane's
/// rows are aggregated as a window's would be, and only the group columns change.
pub(super) fn bounds_only_grouped(
    between: &[Arc<dyn ExecutionPlan>],
    partial: &AggregateExec,
) -> bool {
    let is_bound = |name: &str| name == "window_start" || name == "window_end";
    let uses_bound =
        |expr: &Arc<dyn PhysicalExpr>| collect_columns(expr).iter().any(|c| is_bound(c.name()));
    let passed_through = |expr: &Arc<dyn PhysicalExpr>, name: &str| {
        expr.downcast_ref::<Column>()
            .is_some_and(|c| c.name() == name && is_bound(name))
    };
    for node in between {
        if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
            if projection
                .expr()
                .iter()
                .any(|e| uses_bound(&e.expr) && !passed_through(&e.expr, &e.alias))
            {
                return false;
            }
            continue;
        }
        let mut used = false;
        let visited = node.apply_expressions(&mut |expr| {
            used |= uses_bound(expr);
            Ok(if used {
                TreeNodeRecursion::Stop
            } else {
                TreeNodeRecursion::Continue
            })
        });
        if used || visited.is_err() {
            return false;
        }
    }
    let groups_ok = partial
        .group_expr()
        .expr()
        .iter()
        .all(|(e, name)| !uses_bound(e) || passed_through(e, name));
    let aggregates_ok = partial.aggr_expr().iter().all(|a| {
        !a.expressions().iter().any(uses_bound)
            && !a.order_bys().iter().any(|o| uses_bound(&o.expr))
    });
    let filters_ok = partial
        .filter_expr()
        .iter()
        .flatten()
        .all(|f| !uses_bound(f));
    groups_ok && aggregates_ok && filters_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_sparse_slots_number_groups_alike() {
        let seen = [(3, 1), (0, 0), (3, 1), (2, 4), (0, 0), (0, 4), (2, 4)];
        let mut dense = Slots::new(4, 5);
        let mut sparse = Slots::new(DENSE_SLOTS, 2);
        assert!(matches!(dense, Slots::Dense { .. }));
        assert!(matches!(sparse, Slots::Sparse(_)));
        let (mut new_dense, mut new_sparse) = (0, 0);
        let numbers: Vec<(usize, usize)> = seen
            .iter()
            .map(|&(key, window)| {
                (
                    dense.group(key, window, || new_dense += 1),
                    sparse.group(key, window, || new_sparse += 1),
                )
            })
            .collect();
        let want = [0, 1, 0, 2, 1, 3, 2];
        assert_eq!(numbers, want.iter().map(|&n| (n, n)).collect::<Vec<_>>());
        assert_eq!((new_dense, new_sparse), (4, 4));
    }

    #[test]
    fn a_pane_lies_in_the_windows_that_span_it() {
        let second = 1_000_000_000;
        // Windows of 6 s every 4 s: panes of 2 s.
        let panes = Panes {
            slide: 4 * second,
            size: 6 * second,
            pane: 2 * second,
            start_column: Some(1),
            end_column: Some(2),
            unit: 1,
        };
        // The pane [8 s, 10 s) lies in [4 s, 10 s) and [8 s, 14 s); [6 s, 8 s) in [4 s, 10 s)
        // only.
        assert_eq!(
            panes.windows(10 * second, None),
            Some((4 * second, 8 * second))
        );
        assert_eq!(
            panes.windows(8 * second, None),
            Some((4 * second, 4 * second))
        );
        // Once windows up to 10 s were emitted, only [8 s, 14 s) is left of the first.
        assert_eq!(
            panes.windows(10 * second, Some(10 * second)),
            Some((8 * second, 8 * second))
        );
        assert_eq!(panes.windows(8 * second, Some(10 * second)), None);
        assert_eq!(round_up(-5, 4), -4);
        assert_eq!(round_up(8, 4), 8);
    }
}
