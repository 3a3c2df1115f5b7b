//! Hit rate against capacity, with the offline-optimal line beside it, as SVG and PNG.

use std::path::Path;

use plotters::prelude::*;

/// One point of a capacity sweep.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SweepPoint {
    /// Local cache capacity per instance (device + host pages).
    pub capacity_pages: u64,
    pub hit_rate: f64,
    pub device: f64,
    pub belady: f64,
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    pts: &[SweepPoint],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let xmax = pts.iter().map(|p| p.capacity_pages).max().unwrap_or(1) as f64 * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..xmax, 0f64..100f64)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("cache capacity (device + host pages)")
        .y_desc("prompt tokens hit (%)")
        .draw()
        .map_err(|e| e.to_string())?;
    let series = [
        (
            "kvtier (all tiers)",
            &BLUE,
            pts.iter()
                .map(|p| (p.capacity_pages as f64, p.hit_rate * 100.0))
                .collect::<Vec<_>>(),
        ),
        (
            "device only",
            &GREEN,
            pts.iter()
                .map(|p| (p.capacity_pages as f64, p.device * 100.0))
                .collect(),
        ),
        (
            "Belady MIN ceiling",
            &RED,
            pts.iter()
                .map(|p| (p.capacity_pages as f64, p.belady * 100.0))
                .collect(),
        ),
    ];
    for (name, color, data) in series {
        let c = *color;
        chart
            .draw_series(LineSeries::new(data.clone(), c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(data.into_iter().map(|p| Circle::new(p, 3, c.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// Writes `{stem}.svg` and `{stem}.png` into `dir`.
pub fn write_sweep_plot(
    dir: &Path,
    stem: &str,
    title: &str,
    pts: &[SweepPoint],
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let svg = dir.join(format!("{stem}.svg"));
    let png = dir.join(format!("{stem}.png"));
    draw(
        SVGBackend::new(&svg, (900, 560)).into_drawing_area(),
        title,
        pts,
    )?;
    draw(
        BitMapBackend::new(&png, (900, 560)).into_drawing_area(),
        title,
        pts,
    )?;
    Ok(())
}
