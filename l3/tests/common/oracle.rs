//! A client worker for the failover tests: puts (DRAM, not waiting for the SSD), gets and
//! removes on keys of its own while masters die, judged by an oracle.
//!
//! Each key moves through versions: put version v (acknowledged once its DRAM replicas are
//! written), maybe remove it, put v + 1… One thread owns each key, so the expected state
//! is exact: a get must return the live version's bytes, a removed key must not be found, and
//! a live key must not be missing. A put or remove that failed has an unknown outcome: the
//! key is not judged until a later acknowledged remove settles it. Transient errors (-900,
//! -1010) are counted, not judged.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvtier_l3::{L3Error, L3Store, PutOptions, RemoteStore, ReplicateConfig, Tenant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Live(u32),
    Removed,
    Unknown,
}

fn bytes(key: &str, v: u32) -> Vec<u8> {
    let mut b = format!("{key}#{v}#").into_bytes();
    b.resize(1500 + (v as usize % 7) * 100, b'.');
    b
}

/// What a worker saw.
#[derive(Debug, Default)]
pub struct Report {
    pub puts: usize,
    pub removes: usize,
    pub gets: usize,
    pub transient: usize,
    pub violations: Vec<String>,
}

/// Runs until `stop`; the last pass (after stop) re-reads every key it owns.
pub fn worker(c: Arc<RemoteStore>, id: usize, stop: Arc<AtomicBool>) -> Report {
    let tn = Tenant::new("oracle").unwrap();
    let mut r = Report::default();
    let mut keys: BTreeMap<String, State> = (0..6)
        .map(|i| (format!("w{id}-{i}"), State::Removed))
        .collect();
    let mut next: u32 = 0;
    let mut step = 0usize;
    while !stop.load(Ordering::Acquire) {
        step += 1;
        let names: Vec<String> = keys.keys().cloned().collect();
        let k = &names[step % names.len()];
        match keys[k] {
            // Settle an unknown outcome: once a remove is acknowledged (or finds nothing),
            // the key is known to be gone.
            State::Unknown => match c.remove(&tn, k, true) {
                Ok(()) | Err(L3Error::ObjectNotFound) => {
                    keys.insert(k.clone(), State::Removed);
                }
                Err(_) => r.transient += 1,
            },
            State::Removed => {
                next += 1;
                let cfg = ReplicateConfig {
                    replica_num: 1 + (step % 2) as u32,
                };
                let res = c.batch_put_from_with(
                    &tn,
                    std::slice::from_ref(k),
                    &[&bytes(k, next)],
                    PutOptions::default(),
                    cfg,
                );
                match res.map(|mut v| v.remove(0)) {
                    Ok(Ok(())) => {
                        r.puts += 1;
                        keys.insert(k.clone(), State::Live(next));
                    }
                    _ => {
                        r.transient += 1;
                        keys.insert(k.clone(), State::Unknown);
                    }
                }
            }
            State::Live(v) => {
                if step.is_multiple_of(3) {
                    match c.remove(&tn, k, true) {
                        Ok(()) => {
                            r.removes += 1;
                            keys.insert(k.clone(), State::Removed);
                        }
                        _ => {
                            r.transient += 1;
                            keys.insert(k.clone(), State::Unknown);
                        }
                    }
                } else {
                    judge(&c, &tn, k, State::Live(v), &mut r);
                }
            }
        }
    }
    for (k, s) in &keys {
        judge(&c, &tn, k, *s, &mut r);
    }
    r
}

fn judge(c: &RemoteStore, tn: &Tenant, k: &str, s: State, r: &mut Report) {
    r.gets += 1;
    match (c.get(tn, k), s) {
        (_, State::Unknown) => {}
        (Ok(b), State::Live(v)) if b == bytes(k, v) => {}
        (Ok(b), State::Live(v)) => r.violations.push(format!(
            "{k}: expected version {v}, read {:?}",
            String::from_utf8_lossy(&b[..b.len().min(24)])
        )),
        (Ok(_), State::Removed) => r.violations.push(format!("{k}: removed, but read back")),
        (Err(L3Error::ObjectNotFound), State::Removed) => {}
        (Err(L3Error::ObjectNotFound), State::Live(v)) => r
            .violations
            .push(format!("{k}: version {v} was acknowledged, now missing")),
        (Err(_), _) => r.transient += 1,
    }
}
