//! The points of a capacity sweep (`kvtier sim --sweep`): device and host pages scaled
//! ×1/8 … ×4 from the configured sizes, every point checked before any runs.
//!
//! A point the configuration cannot run (e.g. demotion 256 pages ahead with 128 device pages
//! at ×1/8) used to be skipped without a word, and points held at the 8-page floor came out
//! as the same capacity, so a sweep silently had fewer points than it says. Now points of the
//! same capacity (and sizes past `u32`) are refused, and a point that cannot run is left out
//! *and said*: [`Plan::left_out`] names it and why (the sweeps of docs/sim/policies.md and
//! docs/sim/shadow.md on two instances, `--device-pages 512` with `adaptive:256`, are measured
//! over the four points that can run).

use thiserror::Error;

use crate::SimConfig;

/// The factors device and host pages are scaled by, with the labels messages use.
pub const FACTORS: [(f64, &str); 6] = [
    (0.125, "×1/8"),
    (0.25, "×1/4"),
    (0.5, "×1/2"),
    (1.0, "×1"),
    (2.0, "×2"),
    (4.0, "×4"),
];

/// The fewest device (and host) pages a point keeps.
pub const MIN_PAGES: u32 = 8;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SweepError {
    /// Two points are the same capacity (held at [`MIN_PAGES`]).
    #[error(
        "--sweep: the {a} and {b} points are both device {device} / host {host} pages (a point \
         keeps at least {MIN_PAGES} of each): give --device-pages and --host-pages of at least \
         {} to sweep distinct capacities",
        MIN_PAGES * 8
    )]
    Same {
        a: &'static str,
        b: &'static str,
        device: u32,
        host: u32,
    },
    /// A scaled size does not fit the page count's type.
    #[error(
        "--sweep: the {factor} point's {field} would be {pages} pages, past {}",
        u32::MAX
    )]
    TooLarge {
        factor: &'static str,
        field: &'static str,
        pages: u64,
    },
    /// No point can run (the configuration itself cannot).
    #[error("--sweep: no point can run; {0}")]
    Nothing(LeftOut),
}

/// A point the configuration cannot run, and why (the scheduler's `validate` or
/// [`SimConfig::check`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftOut {
    pub factor: &'static str,
    pub device: u32,
    pub host: u32,
    pub reason: String,
}

impl std::fmt::Display for LeftOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the {} point (device {} / host {} pages) cannot run: {}",
            self.factor, self.device, self.host, self.reason
        )
    }
}

/// What a sweep runs: its points' configurations in [`FACTORS`] order, no two of the same
/// capacity, and the points left out.
#[derive(Clone, Debug)]
pub struct Plan {
    pub points: Vec<(&'static str, SimConfig)>,
    pub left_out: Vec<LeftOut>,
}

fn scale(pages: u32, f: f64, factor: &'static str, field: &'static str) -> Result<u32, SweepError> {
    // at most 4 × u32::MAX: exact in a u64
    let pages = (pages as f64 * f) as u64;
    match u32::try_from(pages) {
        Ok(p) => Ok(p.max(MIN_PAGES)),
        Err(_) => Err(SweepError::TooLarge {
            factor,
            field,
            pages,
        }),
    }
}

/// The sweep over `cfg`: every point a run can use, the others left out (said, never
/// skipped silently); points of the same capacity or sizes past `u32` are refused.
pub fn plan(cfg: &SimConfig) -> Result<Plan, SweepError> {
    let mut plan = Plan {
        points: Vec::new(),
        left_out: Vec::new(),
    };
    for (f, factor) in FACTORS {
        let mut c = cfg.clone();
        let s = &mut c.scheduler;
        s.device_pages = scale(s.device_pages, f, factor, "device_pages")?;
        if s.host_enabled {
            s.host_pages = scale(s.host_pages, f, factor, "host_pages")?;
        }
        let (device, host) = (s.device_pages, s.host_pages);
        let valid = c
            .effective_scheduler()
            .validate()
            .map_err(|e| e.to_string())
            .and_then(|()| c.check());
        if let Err(reason) = valid {
            plan.left_out.push(LeftOut {
                factor,
                device,
                host,
                reason,
            });
            continue;
        }
        let same = |(_, o): &&(&str, SimConfig)| {
            (o.scheduler.device_pages, o.scheduler.host_pages) == (device, host)
        };
        if let Some((a, _)) = plan.points.iter().find(same) {
            return Err(SweepError::Same {
                a,
                b: factor,
                device,
                host,
            });
        }
        plan.points.push((factor, c));
    }
    match (plan.points.is_empty(), plan.left_out.first()) {
        (true, Some(first)) => Err(SweepError::Nothing(first.clone())),
        _ => Ok(plan),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sized(device: u32, host: Option<u32>) -> SimConfig {
        let mut c = SimConfig::default();
        c.scheduler.device_pages = device;
        c.scheduler.host_enabled = host.is_some();
        c.scheduler.host_pages = host.unwrap_or(0);
        c
    }

    fn sizes(p: &Plan) -> Vec<(u32, u32)> {
        p.points
            .iter()
            .map(|(_, c)| (c.scheduler.device_pages, c.scheduler.host_pages))
            .collect()
    }

    #[test]
    fn points_scale_device_and_host() {
        let p = plan(&sized(256, Some(512))).unwrap();
        assert_eq!(
            sizes(&p),
            [
                (32, 64),
                (64, 128),
                (128, 256),
                (256, 512),
                (512, 1024),
                (1024, 2048)
            ]
        );
        assert!(p.left_out.is_empty());
        // held at the floor but distinct (the device : host ratio moves)
        assert_eq!(plan(&sized(32, Some(64))).unwrap().points.len(), 6);
        assert_eq!(plan(&sized(64, None)).unwrap().points.len(), 6);
    }

    /// A point the configuration cannot run is left out and named; the others run.
    #[test]
    fn a_point_that_cannot_run_is_left_out_and_named() {
        let mut demote = sized(512, Some(2048));
        demote.scheduler.host_admission = "on-device-eviction:256".parse().unwrap();
        let p = plan(&demote).unwrap();
        assert_eq!(
            sizes(&p),
            [(256, 1024), (512, 2048), (1024, 4096), (2048, 8192)]
        );
        let out: Vec<_> = p.left_out.iter().map(|l| (l.factor, l.device)).collect();
        assert_eq!(out, [("×1/8", 64), ("×1/4", 128)]);
        assert!(p.left_out[0].to_string().contains("×1/8 point (device 64"));
        // nothing can run: an error
        let mut none = sized(256, Some(512));
        none.payload_bytes = 1;
        assert!(matches!(plan(&none), Err(SweepError::Nothing(_))));
    }

    #[test]
    fn points_of_the_same_capacity_or_past_u32_are_refused() {
        let e = plan(&sized(16, Some(16))).unwrap_err();
        assert_eq!(
            e,
            SweepError::Same {
                a: "×1/8",
                b: "×1/4",
                device: 8,
                host: 8
            }
        );
        assert!(e.to_string().contains("--device-pages"), "{e}");
        assert!(matches!(
            plan(&sized(16, None)).unwrap_err(),
            SweepError::Same { .. }
        ));
        let e = plan(&sized(u32::MAX / 2, Some(8))).unwrap_err();
        assert!(
            matches!(
                e,
                SweepError::TooLarge {
                    factor: "×4",
                    field: "device_pages",
                    ..
                }
            ),
            "{e}"
        );
    }
}
