//! Hit rate against capacity, with the offline-optimal line beside it, as SVG and PNG.
//!
//! Why a log-2 capacity axis: sweeps double the capacity at each point, and a linear axis
//! crowds the small capacities, where policies differ most, into one corner. Ticks name the
//! capacity in pages and in GB of KV, so a reader can map the plot to hardware; the y axis is
//! fitted to the data so that small differences between policies stay visible.

use std::path::Path;

use plotters::prelude::*;

use crate::report::Percentiles;

/// One point of a capacity sweep.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SweepPoint {
    /// Local cache capacity per instance (device + host pages).
    pub capacity_pages: u64,
    /// The same capacity in GB of KV (the model's bytes per page).
    pub capacity_gb: f64,
    /// Hit rate of the configured policy (all tiers).
    pub hit_rate: f64,
    /// Part of `hit_rate` served from the device tier.
    pub device: f64,
    /// Time to first token of the configured policy's run (ms).
    pub ttft_ms: Percentiles,
    /// Belady (MIN) ceiling for `capacity_pages` (the local tiers, what the x axis shows).
    pub belady: f64,
    /// Hit rates of the other online policies at the same point (LRU, freq-depth).
    pub compared: Vec<ComparedRate>,
    /// Requests the point ran (accepted) and their prompt tokens: what its hit rates and TTFT
    /// percentiles are of.
    pub requests: u64,
    pub prompt_tokens: u64,
    /// Requests the point rejected (longer than its `max_context_tokens`, which scales with
    /// its device pages) and their prompt tokens: left out of its hit rates and TTFT. Every
    /// policy at one point runs the same requests; points that reject different ones measure
    /// different request sets.
    pub rejected: u64,
    pub rejected_prompt_tokens: u64,
}

impl SweepPoint {
    /// Whether the point ran any request (a point that rejected them all measured nothing).
    pub fn measured(&self) -> bool {
        self.requests > 0
    }

    /// The set of requests the point ran, as far as a sweep can tell them apart: a point
    /// rejects the requests longer than its context limit, so two points that reject as many
    /// requests and prompt tokens reject the same ones.
    pub fn request_set(&self) -> (u64, u64) {
        (self.rejected, self.rejected_prompt_tokens)
    }
}

/// One other policy's hit rate at a sweep point.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ComparedRate {
    pub policy: String,
    pub hit_rate: f64,
    /// Time to first token of that policy's run (ms).
    pub ttft_ms: Percentiles,
}

/// What the plot's title names.
#[derive(Clone, Debug)]
pub struct SweepTitle {
    pub workload: String,
    /// Host pages per device page.
    pub host_per_device: f64,
    /// L3 capacity in pages, if enabled.
    pub l3_pages: Option<u64>,
    pub model: String,
    /// The configured policy's name.
    pub policy: String,
}

impl SweepTitle {
    pub fn text(&self) -> String {
        let l3 = match self.l3_pages {
            Some(p) => format!("L3 {p} pages"),
            None => "no L3".into(),
        };
        format!(
            "{}: device:host 1:{}, {l3}, {}",
            self.workload,
            fmt_num(self.host_per_device),
            self.model
        )
    }
}

fn fmt_num(x: f64) -> String {
    if (x - x.round()).abs() < 1e-9 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// `pages` as a short count (`40K`).
fn short_pages(pages: f64) -> String {
    if pages >= 1024.0 * 1024.0 {
        format!("{}M", fmt_num(pages / (1024.0 * 1024.0)))
    } else if pages >= 1024.0 {
        format!("{}K", fmt_num(pages / 1024.0))
    } else {
        fmt_num(pages)
    }
}

/// The y range: 0 to a little above the highest value, in whole 5 % steps.
fn y_top(pts: &[SweepPoint]) -> f64 {
    let max = pts
        .iter()
        .flat_map(|p| {
            [p.hit_rate, p.device, p.belady]
                .into_iter()
                .chain(p.compared.iter().map(|c| c.hit_rate))
        })
        .fold(0.0f64, f64::max)
        * 100.0;
    ((max * 1.1 / 5.0).ceil() * 5.0).clamp(5.0, 100.0)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &SweepTitle,
    pts: &[SweepPoint],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let lg = |p: u64| (p.max(1) as f64).log2();
    let xmin = pts
        .iter()
        .map(|p| lg(p.capacity_pages))
        .fold(f64::MAX, f64::min);
    let xmax = pts
        .iter()
        .map(|p| lg(p.capacity_pages))
        .fold(f64::MIN, f64::max);
    let (x0, x1) = if xmin <= xmax {
        (xmin.floor(), xmax.ceil().max(xmin.floor() + 1.0))
    } else {
        (0.0, 1.0)
    };
    // GB per page, from any point (all share the page size).
    let gb_per_page = pts
        .iter()
        .find(|p| p.capacity_pages > 0)
        .map_or(0.0, |p| p.capacity_gb / p.capacity_pages as f64);
    let mut chart = ChartBuilder::on(&root)
        .caption(title.text(), ("sans-serif", 20))
        .margin(14)
        .margin_right(48)
        .x_label_area_size(48)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, 0f64..y_top(pts))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_labels((x1 - x0) as usize + 1)
        .x_label_formatter(&|v| {
            let pages = v.exp2();
            format!(
                "{} ({} GB)",
                short_pages(pages),
                fmt_num((pages * gb_per_page).round())
            )
        })
        .x_desc("cache capacity per instance, device + host pages (GB of KV), log scale")
        .y_desc("prompt tokens hit (%)")
        .draw()
        .map_err(|e| e.to_string())?;
    // A point that rejected every request measured nothing: no dot at 0 %.
    let line = |f: &dyn Fn(&SweepPoint) -> Option<f64>| -> Vec<(f64, f64)> {
        pts.iter()
            .filter(|p| p.measured())
            .filter_map(|p| f(p).map(|y| (lg(p.capacity_pages), y * 100.0)))
            .collect()
    };
    // With L3 the hit rates count L3 hits while the ceiling is of the x axis's tiers alone
    // (device + host): a hit rate may pass it, and the legend says why.
    let (tiers, ceiling) = if title.l3_pages.is_some() {
        (
            "all tiers, L3 included",
            "Belady MIN ceiling, device + host only (excludes L3)",
        )
    } else {
        ("all tiers", "Belady MIN ceiling (device + host)")
    };
    let mut series = vec![
        (
            format!("kvtier, {} ({tiers})", title.policy),
            BLUE,
            line(&|p| Some(p.hit_rate)),
        ),
        (
            "device share of hits".to_string(),
            GREEN,
            line(&|p| Some(p.device)),
        ),
        (ceiling.to_string(), RED, line(&|p| Some(p.belady))),
    ];
    let others: Vec<String> = pts
        .first()
        .map(|p| p.compared.iter().map(|c| c.policy.clone()).collect())
        .unwrap_or_default();
    for (i, name) in others.iter().enumerate() {
        let data = line(&|p| {
            p.compared
                .iter()
                .find(|c| &c.policy == name)
                .map(|c| c.hit_rate)
        });
        let color = if i == 0 { BLACK } else { MAGENTA };
        series.push((format!("{name} ({tiers})"), color, data));
    }
    if let Some(note) = rejections_note(pts) {
        series.push((note, RGBColor(128, 128, 128), Vec::new()));
    }
    for (name, c, data) in series {
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

/// The legend's line for points that rejected requests (their hit rates are of the rest),
/// `None` when none did.
fn rejections_note(pts: &[SweepPoint]) -> Option<String> {
    let named: Vec<String> = pts
        .iter()
        .filter(|p| p.rejected > 0)
        .map(|p| {
            if p.measured() {
                format!("{}: {}", short_pages(p.capacity_pages as f64), p.rejected)
            } else {
                format!("{}: all", short_pages(p.capacity_pages as f64))
            }
        })
        .collect();
    (!named.is_empty()).then(|| format!("requests rejected, left out ({})", named.join(", ")))
}

/// Writes `{stem}.svg` and `{stem}.png` into `dir`.
pub fn write_sweep_plot(
    dir: &Path,
    stem: &str,
    title: &SweepTitle,
    pts: &[SweepPoint],
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let svg = dir.join(format!("{stem}.svg"));
    let png = dir.join(format!("{stem}.png"));
    draw(
        SVGBackend::new(&svg, (960, 600)).into_drawing_area(),
        title,
        pts,
    )?;
    draw(
        BitMapBackend::new(&png, (960, 600)).into_drawing_area(),
        title,
        pts,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(pages: u64, hit: f64, belady: f64) -> SweepPoint {
        SweepPoint {
            capacity_pages: pages,
            capacity_gb: pages as f64 * 0.008,
            hit_rate: hit,
            device: hit / 2.0,
            ttft_ms: Percentiles::default(),
            belady,
            compared: vec![ComparedRate {
                policy: "lru".into(),
                hit_rate: hit * 0.9,
                ttft_ms: Percentiles::default(),
            }],
            requests: 1,
            prompt_tokens: 1,
            rejected: 0,
            rejected_prompt_tokens: 0,
        }
    }

    #[test]
    fn the_y_axis_fits_the_data_and_the_title_names_the_setup() {
        let pts = [pt(10_240, 0.05, 0.2), pt(20_480, 0.1, 0.3733)];
        assert_eq!(y_top(&pts), 45.0);
        assert_eq!(y_top(&[pt(8, 0.0, 0.0)]), 5.0);
        let t = SweepTitle {
            workload: "conversation_trace.jsonl".into(),
            host_per_device: 4.0,
            l3_pages: None,
            model: "llama3-8b".into(),
            policy: "lru".into(),
        };
        assert_eq!(
            t.text(),
            "conversation_trace.jsonl: device:host 1:4, no L3, llama3-8b"
        );
        assert_eq!(short_pages(40_960.0), "40K");
        assert_eq!(short_pages(1536.0), "1.50K");
    }
}
