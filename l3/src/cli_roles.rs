//! `kvtier-l3` flags that would be ignored, refused at start instead: a store node
//! (`--role node`) reads none of the master's flags, so one given to it started and did
//! nothing (a `--tenant-quota` on the nodes, which hold a split deployment's DRAM, capped
//! nothing); the SSD tier's flags without an SSD tier (`--offload on-evict` with no
//! `--ssd-dir` started a DRAM-only server: what DRAM evicted was gone); and a tenant named
//! twice in `--tenant-quota` kept one of its two caps. Likewise a node's own flags on a
//! master or a `both` server (`--ping-ms`, `--node-id`, `--master-timeout-ms`).

use clap::ArgMatches;
use clap::parser::ValueSource;

/// The flags only a master reads (roles master and both), by clap id, as written.
const MASTER_ONLY: [(&str, &str); 12] = [
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

/// The flags only a store node reads (role node), by clap id, as written.
const NODE_ONLY: [(&str, &str); 3] = [
    ("node_id", "--node-id"),
    ("ping_ms", "--ping-ms"),
    ("master_timeout_ms", "--master-timeout-ms"),
];

/// The flags of a process's own SSD tier (roles both and node, with `--ssd-dir`).
const SSD_TIER: [(&str, &str); 2] = [("ssd_capacity", "--ssd-capacity"), ("offload", "--offload")];

/// The flags above given on the command line (not left at their defaults), as written.
pub(crate) fn flags_given(m: &ArgMatches) -> Vec<&'static str> {
    MASTER_ONLY
        .iter()
        .chain(&NODE_ONLY)
        .chain(&SSD_TIER)
        .filter(|(id, _)| m.value_source(id) == Some(ValueSource::CommandLine))
        .map(|(_, flag)| *flag)
        .collect()
}

fn named(given: &[&'static str], of: &[(&str, &'static str)]) -> Vec<&'static str> {
    of.iter()
        .map(|(_, f)| *f)
        .filter(|f| given.contains(f))
        .collect()
}

/// Refuses a node given any of the master's flags, naming them.
pub(crate) fn check_node_flags(given: &[&'static str]) -> Result<(), String> {
    refuse_others(
        given,
        &MASTER_ONLY,
        "read by the master (--role master or both): a store node would ignore it",
    )
}

/// Refuses a master or a `both` server given any of a store node's flags, naming them.
pub(crate) fn check_server_flags(given: &[&'static str]) -> Result<(), String> {
    refuse_others(
        given,
        &NODE_ONLY,
        "read by a store node (--role node) only: this server would ignore it",
    )
}

/// Refuses the flags of `of` among `given`: another role reads them (`why`).
fn refuse_others(
    given: &[&'static str],
    of: &[(&str, &'static str)],
    why: &str,
) -> Result<(), String> {
    match named(given, of)[..] {
        [] => Ok(()),
        ref flags => Err(format!(
            "{} {} {why}",
            flags.join(", "),
            if flags.len() == 1 { "is" } else { "are" }
        )),
    }
}

/// Refuses the SSD tier's flags where there is no tier to act on: a master's (its nodes
/// hold the tiers), or a process without `--ssd-dir`; `--promotion-on-hit` on a `both`
/// server without one; a promotion threshold without promotion.
pub(crate) fn check_ssd_flags(
    given: &[&'static str],
    master: bool,
    ssd_dir: bool,
) -> Result<(), String> {
    let tier = named(given, &SSD_TIER);
    if !tier.is_empty() && master {
        return Err(format!(
            "a master holds no SSD tier: give {} to the nodes",
            tier.join(", ")
        ));
    }
    if !tier.is_empty() && !ssd_dir {
        return Err(format!("{} need --ssd-dir (no SSD tier)", tier.join(", ")));
    }
    let on_hit = given.contains(&"--promotion-on-hit");
    if on_hit && !master && !ssd_dir {
        return Err("--promotion-on-hit needs --ssd-dir (no SSD tier to promote from)".into());
    }
    if given.contains(&"--promotion-admission-threshold") && !on_hit {
        return Err("--promotion-admission-threshold needs --promotion-on-hit".into());
    }
    Ok(())
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
