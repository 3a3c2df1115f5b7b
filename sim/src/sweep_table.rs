//! The text a capacity sweep prints: per point, the configured policy and every compared one
//! with its hit rate and its TTFT p50 / p99, the Belady ceiling, the best fixed option, and the
//! capacity each policy needs to match LRU at the sweep's middle point.
//!
//! Why TTFT beside every hit rate: a policy that gains hits by keeping long prompts can still
//! lose on latency (it is the user's measure), and a sweep that prints only hit rates hides it.
//! Why apart from the command: the table is what docs/sim.md's figures are read from, and it
//! is tested on its own.

use std::fmt::Write;

use crate::matching_capacity::{MatchLru, best_fixed};
use crate::plot::SweepPoint;
use crate::report::Percentiles;

/// A duration in ms as the tables print it: ms below a second, s with two decimals above.
pub fn fmt_ms(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{:.2} s", ms / 1000.0)
    }
}

/// `p50 / p99`.
pub fn fmt_ttft(t: &Percentiles) -> String {
    format!("{} / {}", fmt_ms(t.p50), fmt_ms(t.p99))
}

/// The sweep's table: one row per point, one column per policy (`hit % (TTFT p50 / p99)`).
pub fn table(policy: &str, pts: &[SweepPoint]) -> String {
    // Columns: every compared policy of any point (small points may lack demotion).
    let mut others: Vec<&str> = Vec::new();
    for c in pts.iter().flat_map(|p| &p.compared) {
        if !others.contains(&c.policy.as_str()) {
            others.push(&c.policy);
        }
    }
    let mut out = String::new();
    let _ = write!(out, "{:>16} {:>10}", "capacity pages", "device %");
    for name in std::iter::once(policy).chain(others.iter().copied()) {
        let _ = write!(out, " | {name}: hit % (TTFT p50 / p99)");
    }
    let _ = writeln!(out, " | Belady % | rejected (% of prompt tokens)");
    for p in pts {
        if !p.measured() {
            let _ = writeln!(
                out,
                "{:>16} {:>10} | not measured: all {} requests rejected (longer than the point's context limit)",
                p.capacity_pages, "-", p.rejected
            );
            continue;
        }
        let _ = write!(out, "{:>16} {:>10.2}", p.capacity_pages, p.device * 100.0);
        let _ = write!(
            out,
            " | {:.2} ({})",
            p.hit_rate * 100.0,
            fmt_ttft(&p.ttft_ms)
        );
        for o in &others {
            match p.compared.iter().find(|c| c.policy == *o) {
                Some(c) => {
                    let _ = write!(
                        out,
                        " | {:.2} ({})",
                        c.hit_rate * 100.0,
                        fmt_ttft(&c.ttft_ms)
                    );
                }
                None => out.push_str(" | -"),
            }
        }
        let _ = write!(out, " | {:.2}", p.belady * 100.0);
        let _ = match p.rejected {
            0 => writeln!(out, " | 0"),
            n => writeln!(
                out,
                " | {n} ({:.1} %)",
                p.rejected_prompt_tokens as f64 * 100.0
                    / (p.prompt_tokens + p.rejected_prompt_tokens).max(1) as f64
            ),
        };
    }
    if pts.iter().any(|p| p.rejected > 0) {
        out.push_str(
            "(rejected: requests longer than the point's context limit, which scales with its \
             device pages; left out of its hit rates and TTFT. Policies at one point run the \
             same requests; points with other rejections measure other requests)\n",
        );
    }
    out
}

/// The best fixed option per point (with its TTFT), and the capacity each policy needs to
/// match LRU at the sweep's middle point.
pub fn match_lines(policy: &str, pts: &[SweepPoint], m: Option<&MatchLru>) -> String {
    let mut out = String::new();
    for p in pts {
        if let Some((name, rate)) = best_fixed(p) {
            let ttft = p
                .compared
                .iter()
                .find(|c| c.policy == name)
                .map(|c| fmt_ttft(&c.ttft_ms))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "{:>16} best fixed: {name} {:.2} % ({ttft}), {policy} {:+.2} points ({})",
                p.capacity_pages,
                rate * 100.0,
                (p.hit_rate - rate) * 100.0,
                fmt_ttft(&p.ttft_ms)
            );
        }
    }
    let Some(m) = m else { return out };
    let _ = writeln!(
        out,
        "capacity to match LRU's {:.2} % at {} pages:",
        m.lru_hit_rate * 100.0,
        m.at_capacity_pages
    );
    if !m.left_out_capacity_pages.is_empty() {
        let pages: Vec<String> = m
            .left_out_capacity_pages
            .iter()
            .map(u64::to_string)
            .collect();
        let _ = writeln!(
            out,
            "  left out of the match: {} pages (they rejected other requests)",
            pages.join(", ")
        );
    }
    for c in &m.policies {
        let _ = match c.capacity_pages {
            Some(cap) => writeln!(out, "  {:<40} {cap:>12.0} pages", c.policy),
            None => writeln!(out, "  {:<40} {:>12} (not reached)", c.policy, "-"),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::ComparedRate;

    fn ttft(p50: f64, p99: f64) -> Percentiles {
        Percentiles { p50, p90: p99, p99 }
    }

    /// Every hit rate in the table has its own run's TTFT beside it; a policy missing at a
    /// point is a dash; the best fixed line names the best compared policy and its TTFT.
    #[test]
    fn every_hit_rate_has_its_ttft_beside_it() {
        let pts = [
            SweepPoint {
                capacity_pages: 1280,
                capacity_gb: 10.0,
                hit_rate: 0.45,
                device: 0.1,
                ttft_ms: ttft(129_000.0, 300_000.0),
                belady: 0.69,
                compared: vec![ComparedRate {
                    policy: "lru".into(),
                    hit_rate: 0.4564,
                    ttft_ms: ttft(128_500.0, 299_000.0),
                }],
                requests: 1,
                prompt_tokens: 1,
                rejected: 0,
                rejected_prompt_tokens: 0,
            },
            SweepPoint {
                capacity_pages: 2560,
                capacity_gb: 20.0,
                hit_rate: 0.57,
                device: 0.2,
                ttft_ms: ttft(60.0, 2690.0),
                belady: 0.80,
                compared: vec![
                    ComparedRate {
                        policy: "lru".into(),
                        hit_rate: 0.5709,
                        ttft_ms: ttft(61.0, 2700.0),
                    },
                    ComparedRate {
                        policy: "lru + demote".into(),
                        hit_rate: 0.5728,
                        ttft_ms: ttft(25.0, 77.0),
                    },
                ],
                requests: 1,
                prompt_tokens: 1,
                rejected: 0,
                rejected_prompt_tokens: 0,
            },
        ];
        let t = table("adaptive", &pts);
        let rows: Vec<&str> = t.lines().collect();
        assert!(rows[0].contains("adaptive: hit % (TTFT p50 / p99)"), "{t}");
        assert!(rows[0].contains("lru + demote: hit %"), "{t}");
        assert!(rows[1].contains("45.00 (129.00 s / 300.00 s)"), "{t}");
        assert!(rows[1].contains("45.64 (128.50 s / 299.00 s)"), "{t}");
        assert!(rows[1].contains(" | - | 69.00"), "{t}");
        assert!(rows[2].contains("57.28 (25 ms / 77 ms)"), "{t}");
        let m = match_lines("adaptive", &pts, None);
        assert!(
            m.contains("2560 best fixed: lru + demote 57.28 % (25 ms / 77 ms), adaptive -0.28 points (60 ms / 2.69 s)"),
            "{m}"
        );
    }
}
