//! `RemoveByRegex` with Mooncake's semantics (the numbers mirror what Mooncake 0.3.x's master
//! answered side by side, see bindings/tests/test_mooncake_api.py): the pattern is *found*
//! in a key (not matched whole), leased and unfinished objects stay unless `force`, an
//! invalid pattern is -600 and removes nothing, and a tenant only reaches its own keys.
//! Run on the embedded store, over the tarpc server on 127.0.0.1, and through a split
//! master with a store node (real processes); removes by pattern survive a restart.

use std::collections::BTreeSet;
use std::sync::Arc;

mod common;

use common::procs::{master, node};
use common::{client, persisted, t};
use kvtier_l3::rpc::server::ServerOptions;
use kvtier_l3::{EmbeddedStore, L3Store, PutOptions, SsdConfig, StoreConfig, Tenant, spawn_server};
use proptest::prelude::*;

const KEYS: [&str; 6] = ["rx-a1", "rx-a2", "x-rx-a3", "RX-A4", "rx-b1", "rx-lease"];

fn present(s: &dyn L3Store, tn: &Tenant, keys: &[&str]) -> Vec<bool> {
    keys.iter().map(|k| s.is_exist(tn, k).unwrap()).collect()
}

/// The same sequence on any store; `opts` for the puts.
fn scenario(s: &dyn L3Store, opts: PutOptions) {
    let (a, b) = (t("a"), t("b"));
    for k in KEYS {
        s.put(&a, k, k.as_bytes(), opts).unwrap();
    }
    s.put(&b, "rx-a1", b"tenant b", opts).unwrap();
    s.get(&a, "rx-lease").unwrap(); // takes a read lease
    let pending = s.put_start(&a, "rx-pending", 4).unwrap(); // never ended

    // Found anywhere in the key, case-sensitive; tenant b's rx-a1 is out of reach.
    assert_eq!(s.remove_by_regex(&a, "rx-a", false).unwrap(), 3);
    assert_eq!(
        present(s, &a, &KEYS),
        [false, false, false, true, true, true]
    );
    assert_eq!(s.get(&b, "rx-a1").unwrap(), b"tenant b");

    // Invalid patterns: -600, nothing removed.
    for bad in ["(", "[a-", "a{2,1}", "(?i)rx"] {
        assert_eq!(
            s.remove_by_regex(&a, bad, true).unwrap_err().code_i32(),
            -600
        );
    }
    assert_eq!(present(s, &a, &KEYS[3..]), [true, true, true]);

    // Leased and unfinished objects stay unless forced.
    assert_eq!(
        s.remove_by_regex(&a, "^rx-(lease|pending)$", false)
            .unwrap(),
        0
    );
    assert_eq!(
        s.remove_by_regex(&a, "^rx-(lease|pending)$", true).unwrap(),
        2
    );
    // Its pending put is gone (-704 embedded, -703 from a split master).
    assert!(s.put_end(&pending, PutOptions::default()).is_err());
    assert!(!s.is_exist(&a, "rx-lease").unwrap());

    // Anchors and classes; the empty pattern is found in every key.
    assert_eq!(s.remove_by_regex(&a, r"^RX-[A-Z]\d$", false).unwrap(), 1);
    assert_eq!(s.remove_by_regex(&a, "zzz", false).unwrap(), 0);
    assert_eq!(s.remove_by_regex(&a, "", false).unwrap(), 1);
    assert_eq!(present(s, &a, &KEYS), [false; 6]);
    // Tenant b's rx-a1 is leased by the get above.
    assert_eq!(s.remove_by_regex(&b, "", false).unwrap(), 0);
    assert_eq!(s.remove_by_regex(&b, "", true).unwrap(), 1);
}

fn dram() -> StoreConfig {
    StoreConfig {
        local_segment_bytes: 8 << 20,
        ..Default::default()
    }
}

#[test]
fn embedded_store() {
    scenario(&EmbeddedStore::new(dram()).unwrap(), PutOptions::default());
}

#[test]
fn over_the_server() {
    let h = spawn_server(
        Arc::new(EmbeddedStore::new(dram()).unwrap()),
        ServerOptions::default(),
    )
    .unwrap();
    scenario(&client(h.addr, None), PutOptions::default());
}

#[test]
fn through_a_split_master() {
    let m = master(&[], None);
    let _n = node(m.addr, 1, None, None);
    let c = client(m.addr, None);
    assert!(common::procs::eventually(
        std::time::Duration::from_secs(10),
        || c.put(&t("probe"), "p", b"x", PutOptions::default()).is_ok()
    ));
    scenario(&c, PutOptions::default());
}

#[test]
fn removed_by_pattern_stays_removed_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = || StoreConfig {
        ssd: Some(SsdConfig::new(dir.path())),
        ..dram()
    };
    let a = t("a");
    {
        let s = EmbeddedStore::new(cfg()).unwrap();
        scenario(&s, persisted());
        for i in 0..20 {
            s.put(&a, &format!("keep-{i}"), b"k", persisted()).unwrap();
            s.put(&a, &format!("drop-{i}"), b"d", persisted()).unwrap();
        }
        assert_eq!(s.remove_by_regex(&a, "^drop-", false).unwrap(), 20);
    }
    let s = EmbeddedStore::new(cfg()).unwrap();
    let left: Vec<bool> = (0..20)
        .flat_map(|i| [format!("keep-{i}"), format!("drop-{i}")])
        .map(|k| s.is_exist(&a, &k).unwrap())
        .collect();
    assert_eq!(left, [true, false].repeat(20));
    assert_eq!(present(&s, &a, &KEYS), [false; 6]);
}

/// Mooncake's master runs `std::regex` (ECMAScript) over the key's bytes as `char`s in the
/// "C" locale: `\d`, `\w`, `\s` and `\b` are ASCII, `.` is one byte other than `\n` and `\r`.
/// The Unicode classes of the `regex` crate removed more: `^page-\d$` took "page-٣", `^a.b$`
/// took "aéb" (4 bytes) and "a\rb" (keys Mooncake keeps, gone for good).
#[test]
fn classes_and_dot_are_ascii_and_bytewise_as_mooncakes_std_regex() {
    let s = EmbeddedStore::new(dram()).unwrap();
    let a = t("a");
    let keys = [
        "page-1",
        "page-\u{663}",
        "cafe",
        "caf\u{e9}",
        "a\rb",
        "a\u{e9}b",
        "ab\u{e9}",
    ];
    for (pattern, removed) in [
        (r"^page-\d$", vec!["page-1"]),
        (r"^caf\w$", vec!["cafe"]),
        (r"^a.b$", vec![]),
        (r"^a..b$", vec!["a\u{e9}b"]),
        (r"^ab\W\W$", vec!["ab\u{e9}"]),
        (r"^a\Sb$", vec![]),
        (r"fe\b", vec!["cafe"]),
        ("^caf[\u{e9}]{2}$", vec!["caf\u{e9}"]), // a class of the character's two bytes
    ] {
        for k in keys {
            s.put(&a, k, b"v", PutOptions::default()).unwrap();
        }
        let n = s.remove_by_regex(&a, pattern, false).unwrap();
        let gone: Vec<&str> = keys
            .iter()
            .copied()
            .filter(|k| !s.is_exist(&a, k).unwrap())
            .collect();
        assert_eq!((n, gone), (removed.len() as u64, removed), "{pattern:?}");
        s.remove_all(&a, true).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// Over keys mixing ASCII and other characters (non-ASCII digits and letters, `\r`, `\n`):
    /// `\d+` is found iff an ASCII digit is there, `\w` iff an ASCII word byte is, and
    /// `^.{n}$` iff the key is n bytes with no `\n` or `\r` (std::regex over `char`s).
    #[test]
    fn classes_see_ascii_bytes_only(keys in proptest::collection::btree_set("[a1_é٣K\u{212a}\r\n -]{1,5}", 1..12),
                                    n in 1usize..8) {
        let s = EmbeddedStore::new(dram()).unwrap();
        let a = t("a");
        let word = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_';
        for (pattern, found) in [
            (r"\d".to_string(), Box::new(|k: &str| k.bytes().any(|b| b.is_ascii_digit())) as Box<dyn Fn(&str) -> bool>),
            (r"\w".to_string(), Box::new(move |k: &str| k.bytes().any(|b| word(&b)))),
            (format!("^.{{{n}}}$"), Box::new(move |k: &str| k.len() == n && !k.bytes().any(|b| b == b'\n' || b == b'\r'))),
        ] {
            for k in &keys {
                s.put(&a, k, b"v", PutOptions::default()).unwrap();
            }
            let want: BTreeSet<&String> = keys.iter().filter(|k| found(k)).collect();
            prop_assert_eq!(s.remove_by_regex(&a, &pattern, false).unwrap(), want.len() as u64, "{}", pattern);
            for k in &keys {
                prop_assert_eq!(s.is_exist(&a, k).unwrap(), !want.contains(k), "{} {:?}", pattern, k);
                s.remove(&a, k, true).ok();
            }
        }
    }

    /// A prefix pattern removes exactly the keys with that prefix (and only the caller's).
    #[test]
    fn prefix_removes_exactly_its_keys(keys in proptest::collection::btree_set("[ab]{1,4}", 1..20),
                                       prefix in "[ab]{1,2}") {
        let s = EmbeddedStore::new(dram()).unwrap();
        let (a, b) = (t("a"), t("b"));
        for k in &keys {
            s.put(&a, k, b"v", PutOptions::default()).unwrap();
            s.put(&b, k, b"v", PutOptions::default()).unwrap();
        }
        let want: BTreeSet<&String> = keys.iter().filter(|k| k.starts_with(&prefix)).collect();
        prop_assert_eq!(s.remove_by_regex(&a, &format!("^{prefix}"), false).unwrap(), want.len() as u64);
        for k in &keys {
            prop_assert_eq!(s.is_exist(&a, k).unwrap(), !want.contains(k));
            prop_assert!(s.is_exist(&b, k).unwrap());
        }
    }
}
