//! `kvtier-l3` flags that would be ignored, refused at start instead: a store node
//! (`--role node`) reads none of the master's flags, so one given to it started and did
//! nothing (a `--tenant-quota` on the nodes, which hold a split deployment's DRAM, capped
//! nothing); and a tenant named twice in `--tenant-quota` kept one of its two caps.

use clap::ArgMatches;
use clap::parser::ValueSource;

/// The flags only a master reads (roles master and both), by clap id, as written.
pub(crate) const MASTER_ONLY: [(&str, &str); 12] = [
    ("tenant_quota", "--tenant-quota"),
    ("lease_ms", "--lease-ms"),
    ("client_ttl_ms", "--client-ttl-ms"),
    ("client_segments_max_bytes", "--client-segments-max-bytes"),
    ("promotion_on_hit", "--promotion-on-hit"),
    (
        "promotion_admission_threshold",
        "--promotion-admission-threshold",
    ),
    ("loss_journal_keys", "--loss-journal-keys"),
    ("rebuild_timeout_ms", "--rebuild-timeout-ms"),
    ("kv_events_block_size", "--kv-events-block-size"),
    ("kv_events_parts_per_page", "--kv-events-parts-per-page"),
    ("cluster", "--cluster"),
    ("leader_ttl_s", "--leader-ttl-s"),
];

/// The master's flags given on the command line (not left at their defaults).
pub(crate) fn master_flags_given(m: &ArgMatches) -> Vec<&'static str> {
    MASTER_ONLY
        .iter()
        .filter(|(id, _)| m.value_source(id) == Some(ValueSource::CommandLine))
        .map(|(_, flag)| *flag)
        .collect()
}

/// Refuses a node given any of the master's flags, naming them.
pub(crate) fn check_node_flags(given: &[&str]) -> Result<(), String> {
    match given {
        [] => Ok(()),
        flags => Err(format!(
            "{} {} read by the master (--role master or both): a store node would ignore it",
            flags.join(", "),
            if flags.len() == 1 { "is" } else { "are" }
        )),
    }
}

/// Refuses a tenant named more than once in `--tenant-quota` (which cap was meant?).
pub(crate) fn check_quotas(quotas: &[(String, u64)]) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    match quotas.iter().find(|(name, _)| !seen.insert(name.as_str())) {
        Some((name, _)) => Err(format!(
            "--tenant-quota names tenant {name:?} more than once"
        )),
        None => Ok(()),
    }
}
