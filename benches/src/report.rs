//! The benchmark report: JSON with every time, a markdown table of medians with ratios to
//! DataFusion and geometric means, and an SVG chart.

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

use crate::engines::{Engine, EngineRun, Outcome};

/// The cost model device work is priced with (see `fulmen_kernels::cost`).
const COST: fulmen_kernels::cost::CostModel = fulmen_kernels::cost::H200;

/// Everything a run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// `tpch`.
    pub benchmark: String,
    /// Scale factor.
    pub scale_factor: f64,
    /// Iterations per query.
    pub iterations: usize,
    /// Query names, in order.
    pub queries: Vec<String>,
    /// One run per engine.
    pub runs: Vec<EngineRun>,
    /// The machine, in words.
    pub machine: String,
    /// The date (UTC).
    pub date: String,
    /// The command that produced it.
    pub command: String,
}

/// The median of some times.
pub fn median(times: &[f64]) -> Option<f64> {
    if times.is_empty() {
        return None;
    }
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    let mid = t.len() / 2;
    Some(if t.len() % 2 == 1 {
        t[mid]
    } else {
        (t[mid - 1] + t[mid]) / 2.0
    })
}

/// The fastest of some times: on a shared machine the least disturbed run, so ratios of
/// minima move less from run to run than ratios of medians.
pub fn best(times: &[f64]) -> Option<f64> {
    times.iter().copied().min_by(f64::total_cmp)
}

impl Report {
    /// The benchmark's name as people write it.
    fn title(&self) -> String {
        match self.benchmark.as_str() {
            "tpch" => "TPC-H".to_string(),
            other => other.to_uppercase(),
        }
    }

    fn medians(&self, run: &EngineRun) -> Vec<Option<f64>> {
        self.per_query(run, median)
    }

    fn per_query(&self, run: &EngineRun, of: fn(&[f64]) -> Option<f64>) -> Vec<Option<f64>> {
        (0..self.queries.len())
            .map(|i| match run.outcomes.get(i) {
                Some(Outcome::Ran { times_ms, .. }) => of(times_ms),
                _ => None,
            })
            .collect()
    }

    /// Per query, `engine`'s time over DataFusion's (by `of`), where both ran.
    pub fn ratios(&self, engine: Engine, of: fn(&[f64]) -> Option<f64>) -> Vec<Option<f64>> {
        let (Some(base), Some(run)) = (
            self.reference(),
            self.runs.iter().find(|r| r.engine == engine),
        ) else {
            return Vec::new();
        };
        let (base, mine) = (self.per_query(base, of), self.per_query(run, of));
        base.iter()
            .zip(mine)
            .map(|(b, m)| match (b, m) {
                (Some(b), Some(m)) if *b > 0.0 => Some(m / b),
                _ => None,
            })
            .collect()
    }

    fn reference(&self) -> Option<&EngineRun> {
        self.runs.iter().find(|r| r.engine == Engine::DataFusion)
    }

    /// The geometric mean of an engine's medians over the queries every engine that ran
    /// answered.
    pub fn geomean(&self, run: &EngineRun) -> Option<f64> {
        let ran: Vec<Vec<Option<f64>>> = self
            .runs
            .iter()
            .filter(|r| !r.outcomes.is_empty())
            .map(|r| self.medians(r))
            .collect();
        let mine = self.medians(run);
        let logs: Vec<f64> = (0..self.queries.len())
            .filter(|&q| ran.iter().all(|m| m[q].is_some()))
            .filter_map(|q| mine[q])
            .map(|t| t.max(1e-3).ln())
            .collect();
        (!logs.is_empty()).then(|| (logs.iter().sum::<f64>() / logs.len() as f64).exp())
    }

    /// The report as JSON.
    pub fn json(&self) -> serde_json::Value {
        let runs: Vec<_> = self
            .runs
            .iter()
            .map(|r| {
                let queries: Vec<_> = self
                    .queries
                    .iter()
                    .zip(&r.outcomes)
                    .map(|(q, o)| match o {
                        Outcome::Ran {
                            times_ms, device, ..
                        } => {
                            let mut entry = serde_json::json!({"query": q, "times_ms": times_ms, "median_ms": median(times_ms), "best_ms": best(times_ms)});
                            if let Some(c) = device {
                                entry["device"] = serde_json::json!({
                                    "launches": c.launches, "syncs": c.syncs, "stream_waits": c.stream_waits,
                                    "h2d_bytes": c.h2d_bytes, "d2h_bytes": c.d2h_bytes,
                                    "device_bytes": c.device_bytes,
                                    "traffic_ratio": traffic_ratio(c),
                                    "modelled_ms": COST.seconds(c) * 1e3,
                                    "modelled_resident_ms": COST.resident_seconds(c) * 1e3,
                                    "model": COST.name,
                                });
                            }
                            entry
                        }
                        Outcome::Failed(e) => serde_json::json!({"query": q, "error": e}),
                    })
                    .collect();
                serde_json::json!({
                    "engine": r.engine.to_string(),
                    "note": r.note,
                    "geomean_ms": self.geomean(r),
                    "queries": queries,
                })
            })
            .collect();
        serde_json::json!({
            "benchmark": self.benchmark,
            "scale_factor": self.scale_factor,
            "iterations": self.iterations,
            "machine": self.machine,
            "date": self.date,
            "command": self.command,
            "engines": runs,
        })
    }

    /// The report as a markdown table: median milliseconds per query and engine, with the
    /// ratio to DataFusion in parentheses (below 1: faster than DataFusion).
    pub fn markdown(&self) -> String {
        let ran: Vec<&EngineRun> = self
            .runs
            .iter()
            .filter(|r| !r.outcomes.is_empty())
            .collect();
        let reference = self.reference().map(|r| self.medians(r));
        let mut out = format!(
            "### {} at scale factor {} — median of {} runs, milliseconds (ratio to DataFusion)\n\n",
            self.title(),
            self.scale_factor,
            self.iterations
        );
        out += &format!(
            "Machine: {}. Date: {}. Command: `{}`\n\n",
            self.machine, self.date, self.command
        );
        out += "| query |";
        for r in &ran {
            out += &format!(" {} |", r.engine);
        }
        out += "\n|---|";
        out += &"---:|".repeat(ran.len());
        out += "\n";
        let cell = |t: Option<f64>, base: Option<f64>, failed: bool| match (t, base) {
            (Some(t), Some(b)) if b > 0.0 => format!("{t:.1} ({:.2})", t / b),
            (Some(t), _) => format!("{t:.1}"),
            (None, _) if failed => "failed".to_string(),
            (None, _) => "—".to_string(),
        };
        let medians: Vec<Vec<Option<f64>>> = ran.iter().map(|r| self.medians(r)).collect();
        for (q, name) in self.queries.iter().enumerate() {
            out += &format!("| {name} |");
            for (r, m) in ran.iter().zip(&medians) {
                let failed = matches!(r.outcomes.get(q), Some(Outcome::Failed(_)));
                let base = reference.as_ref().and_then(|b| b[q]);
                out += &format!(" {} |", cell(m[q], base, failed));
            }
            out += "\n";
        }
        let base = self.reference().and_then(|r| self.geomean(r));
        out += "| **geometric mean** |";
        for r in &ran {
            out += &format!(" **{}** |", cell(self.geomean(r), base, false));
        }
        out += "\n";
        for r in &self.runs {
            if let Some(note) = &r.note {
                out += &format!("\n- {}: {note}", r.engine);
            }
        }
        out += "\n";
        // Fulmen with the GPU off plans exactly what DataFusion plans (a test checks it), so
        // its ratio is the overhead check; the best run is the least disturbed one.
        for engine in [Engine::Fulmen, Engine::FulmenGpu] {
            let (by_median, by_best) = (self.ratios(engine, median), self.ratios(engine, best));
            let worst = |ratios: &[Option<f64>]| {
                ratios
                    .iter()
                    .enumerate()
                    .filter_map(|(q, r)| r.map(|r| (q, r)))
                    .max_by(|a, b| (a.1 - 1.0).abs().total_cmp(&(b.1 - 1.0).abs()))
            };
            if let (Some((qm, m)), Some((qb, b))) = (worst(&by_median), worst(&by_best)) {
                out += &format!(
                    "\n- {engine} against datafusion, per query: the ratio furthest from 1 is \
                     {m:.2} ({}) by median and {b:.2} ({}) by best run\n",
                    self.queries[qm], self.queries[qb]
                );
            }
        }
        out += &self.device_work_markdown();
        out
    }

    /// The device work of each query that counted some, with the cost model's time beside
    /// DataFusion's measured median: a markdown section, empty when no engine used a device.
    pub fn device_work_markdown(&self) -> String {
        let reference = self.reference().map(|r| self.medians(r));
        let mut out = String::new();
        for run in &self.runs {
            let rows: Vec<(usize, &fulmen_kernels::DeviceCounts)> = run
                .outcomes
                .iter()
                .enumerate()
                .filter_map(|(q, o)| match o {
                    Outcome::Ran {
                        device: Some(c), ..
                    } => Some((q, c)),
                    _ => None,
                })
                .collect();
            if rows.is_empty() {
                continue;
            }
            out += &format!(
                "\n### Device work of {} per query (counted), and the {} cost model's time \
                 (a MODEL, not a measurement)\n\n",
                run.engine, COST.name
            );
            out += &format!(
                "| query | launches | syncs | stream waits | h2d MB | d2h MB | device MB | traffic ratio | modelled {} ms, from host | modelled ms, resident | datafusion measured ms |\n",
                COST.name
            );
            out += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
            let mb = |b: u64| b as f64 / 1e6;
            for (q, c) in rows {
                let measured = reference
                    .as_ref()
                    .and_then(|m| m[q])
                    .map_or("—".to_string(), |t| format!("{t:.1}"));
                let ratio = traffic_ratio(c).map_or("—".to_string(), |r| format!("{r:.2}"));
                out += &format!(
                    "| {} | {} | {} | {} | {:.2} | {:.3} | {:.1} | {ratio} | {:.3} | {:.3} | {measured} |\n",
                    self.queries[q],
                    c.launches,
                    c.syncs,
                    c.stream_waits,
                    mb(c.h2d_bytes),
                    mb(c.d2h_bytes),
                    mb(c.device_bytes),
                    COST.seconds(c) * 1e3,
                    COST.resident_seconds(c) * 1e3,
                );
            }
        }
        out
    }

    /// Writes a grouped bar chart of the medians (log scale) as SVG.
    pub fn svg(&self, path: &Path) -> Result<()> {
        let ran: Vec<&EngineRun> = self
            .runs
            .iter()
            .filter(|r| !r.outcomes.is_empty())
            .collect();
        let medians: Vec<Vec<Option<f64>>> = ran.iter().map(|r| self.medians(r)).collect();
        let max = medians
            .iter()
            .flatten()
            .flatten()
            .cloned()
            .fold(1.0f64, f64::max);
        let min = medians
            .iter()
            .flatten()
            .flatten()
            .cloned()
            .fold(max, f64::min)
            .max(0.01);
        let width = 140 + 46 * self.queries.len() as u32;
        let root = SVGBackend::new(path, (width.max(640), 480)).into_drawing_area();
        root.fill(&WHITE)?;
        let title = format!(
            "{} SF {} — median ms (log scale)",
            self.title(),
            self.scale_factor
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(
                0f64..self.queries.len() as f64,
                (min / 2.0..max * 2.0).log_scale(),
            )?;
        let names = self.queries.clone();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(self.queries.len())
            .x_label_formatter(&|x| names.get(x.floor() as usize).cloned().unwrap_or_default())
            .y_desc("ms")
            .draw()?;
        let n = ran.len().max(1) as f64;
        for (e, (run, m)) in ran.iter().zip(&medians).enumerate() {
            let color = Palette99::pick(e).to_rgba();
            let bars = m.iter().enumerate().filter_map(|(q, t)| {
                t.map(|t| {
                    let x0 = q as f64 + 0.1 + 0.8 * e as f64 / n;
                    let x1 = x0 + 0.8 / n;
                    Rectangle::new([(x0, min / 2.0), (x1, t)], color.filled())
                })
            });
            chart
                .draw_series(bars)?
                .label(run.engine.to_string())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()?;
        root.present()?;
        Ok(())
    }
}

/// A query's traffic ratio: the device bytes its launches were given (an upper bound of
/// what they touch) over the bytes it uploaded (the columns it reads from host memory);
/// `None` when nothing went up.
fn traffic_ratio(c: &fulmen_kernels::DeviceCounts) -> Option<f64> {
    (c.h2d_bytes > 0).then(|| c.device_bytes as f64 / c.h2d_bytes as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(engine: Engine, times: &[&[f64]]) -> EngineRun {
        EngineRun {
            engine,
            note: None,
            outcomes: times
                .iter()
                .map(|t| Outcome::Ran {
                    times_ms: t.to_vec(),
                    rows: vec![],
                    device: None,
                })
                .collect(),
        }
    }

    #[test]
    fn medians_ratios_and_geometric_means() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        let report = Report {
            benchmark: "tpch".into(),
            scale_factor: 1.0,
            iterations: 3,
            queries: vec!["Q1".into(), "Q2".into()],
            runs: vec![
                run(Engine::DataFusion, &[&[10.0, 12.0, 11.0], &[100.0]]),
                run(Engine::Fulmen, &[&[5.0], &[400.0]]),
            ],
            machine: "test".into(),
            date: "today".into(),
            command: "fulmen-bench".into(),
        };
        let gm = report.geomean(&report.runs[1]).unwrap();
        assert!((gm - (5.0f64 * 400.0).sqrt()).abs() < 1e-9);
        let md = report.markdown();
        assert!(md.contains("| Q1 | 11.0 (1.00) | 5.0 (0.45) |"), "{md}");
        assert!(md.contains("| Q2 | 100.0 (1.00) | 400.0 (4.00) |"), "{md}");
        // Q1: medians 11 and 5, best runs 10 and 5; Q2 is 4.00 either way, furthest from 1.
        assert_eq!(best(&[3.0, 1.0, 2.0]), Some(1.0));
        assert_eq!(
            report.ratios(Engine::Fulmen, best),
            vec![Some(0.5), Some(4.0)]
        );
        assert!(
            md.contains(
                "the ratio furthest from 1 is 4.00 (Q2) by median and 4.00 (Q2) by best run"
            ),
            "{md}"
        );
        let dir = std::env::temp_dir().join(format!("fulmen-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let svg = dir.join("chart.svg");
        report.svg(&svg).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(
            text.starts_with("<svg") && text.contains("fulmen"),
            "{}",
            &text[..100.min(text.len())]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
