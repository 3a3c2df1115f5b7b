//! Property tests on the embedded store: tenant isolation against a per-tenant model, and
//! eviction that never drops a leased object.

use std::collections::HashMap;

use kvtier_l3::{EmbeddedStore, L3Store, PutOptions, StoreConfig, Tenant};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Put(usize, u8, u8),
    Get(usize, u8),
    Remove(usize, u8),
    RemoveAll(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..3, 0u8..6, any::<u8>()).prop_map(|(t, k, v)| Op::Put(t, k, v)),
        (0usize..3, 0u8..6).prop_map(|(t, k)| Op::Get(t, k)),
        (0usize..3, 0u8..6).prop_map(|(t, k)| Op::Remove(t, k)),
        (0usize..3).prop_map(Op::RemoveAll),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Every tenant sees exactly its own model, whatever the others do with the same keys.
    #[test]
    fn tenant_isolation(ops in proptest::collection::vec(op(), 1..60)) {
        let s = EmbeddedStore::new(StoreConfig { local_segment_bytes: 1 << 20, ..Default::default() }).unwrap();
        let tenants: Vec<Tenant> = ["a", "b", "c"].iter().map(|n| Tenant::new(*n).unwrap()).collect();
        let mut model: Vec<HashMap<String, Vec<u8>>> = vec![HashMap::new(); 3];
        for o in ops {
            match o {
                Op::Put(t, k, v) => {
                    let key = format!("k{k}");
                    let r = s.put(&tenants[t], &key, &[v; 3], PutOptions::default());
                    if let std::collections::hash_map::Entry::Vacant(e) = model[t].entry(key) {
                        prop_assert!(r.is_ok());
                        e.insert(vec![v; 3]);
                    } else {
                        prop_assert_eq!(r.unwrap_err().code_i32(), -705);
                    }
                }
                Op::Get(t, k) => {
                    let key = format!("k{k}");
                    match model[t].get(&key) {
                        Some(v) => prop_assert_eq!(&s.get(&tenants[t], &key).unwrap(), v),
                        None => prop_assert_eq!(s.get(&tenants[t], &key).unwrap_err().code_i32(), -704),
                    }
                }
                Op::Remove(t, k) => {
                    let key = format!("k{k}");
                    let r = s.remove(&tenants[t], &key, true);
                    prop_assert_eq!(r.is_ok(), model[t].remove(&key).is_some());
                }
                Op::RemoveAll(t) => {
                    let n = s.remove_all(&tenants[t], true).unwrap();
                    prop_assert_eq!(n as usize, model[t].len());
                    model[t].clear();
                }
            }
            // stats() reads the master's census, kept at every change: it counts the model
            let st = s.stats().unwrap();
            let n = model.iter().map(|m| m.len() as u64).sum::<u64>();
            prop_assert_eq!((st.objects, st.mem_objects, st.disk_objects), (n, n, 0));
            for (t, m) in model.iter().enumerate() {
                let keys: Vec<String> = (0..6).map(|k| format!("k{k}")).collect();
                let ex = s.batch_is_exist(&tenants[t], &keys).unwrap();
                for (k, e) in keys.iter().zip(ex) {
                    prop_assert_eq!(e.unwrap(), m.contains_key(k));
                }
            }
        }
    }

    /// Under memory pressure, an object read within its lease is never evicted.
    #[test]
    fn eviction_never_drops_leased(reads in proptest::collection::vec(0usize..40, 1..30), extra in 5usize..40) {
        let s = EmbeddedStore::new(StoreConfig { local_segment_bytes: 64 * 1024, ..Default::default() }).unwrap();
        let t = Tenant::new("t").unwrap();
        for i in 0..40 {
            let _ = s.put(&t, &format!("k{i}"), &[1u8; 1024], PutOptions::default());
        }
        let mut leased = Vec::new();
        for r in reads {
            if s.get(&t, &format!("k{r}")).is_ok() {
                leased.push(r);
            }
        }
        for i in 0..extra {
            let _ = s.put(&t, &format!("x{i}"), &[2u8; 2048], PutOptions::default());
        }
        for r in leased {
            prop_assert!(s.is_exist(&t, &format!("k{r}")).unwrap(), "leased k{} evicted", r);
        }
        let st = s.stats().unwrap();
        prop_assert!(st.mem_used_bytes <= st.mem_capacity_bytes);
    }
}
