//! The SSD tier's open bucket files: a bounded, least-recently-used cache of descriptors.
//!
//! Why: reads open a bucket once and keep it open for the next read of it; kept for every
//! bucket ever read (until the bucket was deleted), the descriptors of a tier of many small
//! buckets reached the process's limit — reads then failed with EMFILE on every pass and
//! new clients could not connect (an adversarial tester: `nofile` 256, 400 buckets). Now at
//! most `cap` stay open; the least recently used one is dropped from the cache to make room,
//! and closes once the last read using it ends (readers hold an `Arc`).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::sync::Arc;

/// Fewest bucket files kept open, whatever the descriptor limit.
pub const MIN_OPEN_FILES: usize = 8;
/// Most bucket files kept open, whatever the descriptor limit.
pub const MAX_OPEN_FILES: usize = 1024;

/// Bucket files kept open for a process whose descriptor limit (`RLIMIT_NOFILE`, soft) is
/// `nofile`: an eighth of it (RPC connections may take half), within
/// [`MIN_OPEN_FILES`]..=[`MAX_OPEN_FILES`].
pub fn cap_for(nofile: u64) -> usize {
    usize::try_from(nofile / 8)
        .unwrap_or(MAX_OPEN_FILES)
        .clamp(MIN_OPEN_FILES, MAX_OPEN_FILES)
}

/// [`cap_for`] this process's descriptor limit now.
pub fn default_cap() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return MIN_OPEN_FILES;
    }
    cap_for(r.rlim_cur)
}

/// Open bucket files by id, at most `cap`, the least recently used dropped first.
#[derive(Debug)]
pub struct OpenFiles {
    cap: usize,
    by_id: HashMap<u64, (Arc<File>, u64)>,
    /// Use stamp → id, oldest first.
    order: BTreeMap<u64, u64>,
    clock: u64,
}

impl Default for OpenFiles {
    fn default() -> Self {
        OpenFiles::new(MIN_OPEN_FILES)
    }
}

impl OpenFiles {
    /// An empty cache of at most `cap` (at least 1) files.
    pub fn new(cap: usize) -> Self {
        OpenFiles {
            cap: cap.max(1),
            by_id: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Files open now (in the cache).
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether no file is cached.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Most files kept.
    pub fn cap(&self) -> usize {
        self.cap
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The file of bucket `id`, marked most recently used.
    pub fn get(&mut self, id: u64) -> Option<Arc<File>> {
        let now = self.tick();
        let (f, stamp) = self.by_id.get_mut(&id)?;
        self.order.remove(stamp);
        *stamp = now;
        self.order.insert(now, id);
        Some(f.clone())
    }

    /// Keeps `f` as bucket `id`'s file, dropping the least recently used past the cap.
    pub fn insert(&mut self, id: u64, f: Arc<File>) {
        self.remove(id);
        while self.by_id.len() >= self.cap {
            let Some((_, old)) = self.order.pop_first() else {
                break;
            };
            self.by_id.remove(&old);
        }
        let now = self.tick();
        self.by_id.insert(id, (f, now));
        self.order.insert(now, id);
    }

    /// Forgets bucket `id`'s file (the bucket is gone).
    pub fn remove(&mut self, id: u64) {
        if let Some((_, stamp)) = self.by_id.remove(&id) {
            self.order.remove(&stamp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> Arc<File> {
        Arc::new(tempfile::tempfile().unwrap())
    }

    #[test]
    fn keeps_the_most_recently_used_within_the_cap() {
        let mut c = OpenFiles::new(3);
        for id in 0..3 {
            c.insert(id, file());
        }
        assert!(c.get(0).is_some()); // 1 is now the least recent
        c.insert(3, file());
        assert_eq!(c.len(), 3);
        assert!(c.get(1).is_none());
        assert!(c.get(0).is_some() && c.get(2).is_some() && c.get(3).is_some());
        c.remove(2);
        assert_eq!(c.len(), 2);
        c.insert(4, file());
        c.insert(5, file());
        assert_eq!(c.len(), 3);
        assert!(c.get(0).is_none(), "0 was the least recent");
        assert_eq!(c.order.len(), c.by_id.len());
    }

    #[test]
    fn an_evicted_file_stays_usable_by_its_reader() {
        let mut c = OpenFiles::new(1);
        let f = file();
        c.insert(1, f.clone());
        let held = c.get(1).unwrap();
        c.insert(2, file());
        assert!(c.get(1).is_none());
        // The reader's handle still works; it closes when the last one drops.
        assert!(held.metadata().is_ok());
        assert_eq!(Arc::strong_count(&f), 2);
    }

    #[test]
    fn the_cap_follows_the_descriptor_limit() {
        assert_eq!(cap_for(256), 32);
        assert_eq!(cap_for(16), MIN_OPEN_FILES);
        assert_eq!(cap_for(1 << 20), MAX_OPEN_FILES);
    }
}
