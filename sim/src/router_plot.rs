//! The router benchmark's plot: TTFT p99 of every router at every (workload, instances,
//! load), as SVG and PNG.
//!
//! Why p99 on a log axis: the routers differ by orders of magnitude at the tail when one
//! instance is overloaded, and a linear axis would flatten the rest to the floor. One line
//! per router, the configurations along x, so a reader sees at once where a router wins.

use std::path::Path;

use plotters::prelude::*;

use crate::router_bench::BenchRow;
use crate::workload::Routing;

/// The configurations in row order (workload, instances, load), each once.
fn configurations(rows: &[BenchRow]) -> Vec<(String, usize, f64)> {
    let mut out: Vec<(String, usize, f64)> = Vec::new();
    for r in rows {
        let k = (r.workload.clone(), r.instances, r.load);
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    rows: &[BenchRow],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let confs = configurations(rows);
    let ys = rows.iter().map(|r| r.ttft_ms.p99.max(1.0));
    let ymax = ys.clone().fold(1.0, f64::max) * 2.0;
    let ymin = ys.fold(f64::MAX, f64::min).min(ymax / 4.0) / 2.0;
    let n = confs.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT p99 by router (simulated)", ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(90)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), (ymin..ymax).log_scale())
        .map_err(|e| e.to_string())?;
    let label = |v: &f64| {
        let i = v.round();
        if (v - i).abs() > 0.01 || i < 0.0 {
            return String::new();
        }
        confs
            .get(i as usize)
            .map(|(w, inst, load)| format!("{w} {inst}x {:.0}%", load * 100.0))
            .unwrap_or_default()
    };
    chart
        .configure_mesh()
        .x_labels(n)
        .x_label_formatter(&label)
        .x_label_style(
            ("sans-serif", 11)
                .into_font()
                .transform(FontTransform::Rotate90),
        )
        .y_desc("TTFT p99 (ms), log scale")
        .draw()
        .map_err(|e| e.to_string())?;
    let colors = [BLACK, MAGENTA, CYAN, RED, BLUE];
    for (router, color) in Routing::ALL.iter().zip(colors) {
        let data: Vec<(f64, f64)> = confs
            .iter()
            .enumerate()
            .filter_map(|(i, (w, inst, load))| {
                rows.iter()
                    .find(|r| {
                        &r.workload == w
                            && r.instances == *inst
                            && r.load == *load
                            && r.router == router.name()
                    })
                    .map(|r| (i as f64, r.ttft_ms.p99.max(1.0)))
            })
            .collect();
        if data.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(data.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(router.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(data.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// Writes `router-bench.svg` and `router-bench.png` into `dir`.
pub fn write_router_plot(dir: &Path, rows: &[BenchRow]) -> Result<(), String> {
    let svg = dir.join("router-bench.svg");
    let png = dir.join("router-bench.png");
    draw(SVGBackend::new(&svg, (1100, 640)).into_drawing_area(), rows)?;
    draw(
        BitMapBackend::new(&png, (1100, 640)).into_drawing_area(),
        rows,
    )
}
