//! Puts whose bytes are written straight into the store's own buffers by the caller: the
//! allocate-then-fill path.
//!
//! Why: the shared-memory path's in-place mode (`rpc::shm::inplace`) copies a client's bytes
//! with `process_vm_readv`, and the only copy worth paying is the one into the buffer that
//! becomes the replica. `batch_put_from_with` takes `&[u8]`s, which would force the bytes
//! into this process first (a second copy). Here the batch is allocated first (as
//! `batch_put_from_with` does: a batch never evicts its own keys), then each key's buffer
//! is handed to a [`Filler`]; a key whose fill fails is revoked, so a put is all-or-nothing
//! per key, as on every other path.

use std::mem::MaybeUninit;
use std::time::Instant;

use crate::api::BatchResult;
use crate::buffers;
use crate::error::{L3Error, L3Result};
use crate::metrics::Op;
use crate::types::{PutHandle, PutOptions, ReplicateConfig, Tenant};

use super::EmbeddedStore;

/// Writes the bytes of a batch's keys into the buffers the store hands out.
///
/// # Safety
/// An implementation's [`Filler::fill`] must initialise every byte of `dst` when it returns
/// `Ok`: the store then reads the buffer as the object's bytes.
pub unsafe trait Filler {
    /// Writes key `i`'s bytes (exactly `dst.len()` of them) into `dst`.
    fn fill(&mut self, i: usize, dst: &mut [MaybeUninit<u8>]) -> L3Result<()>;
}

impl EmbeddedStore {
    /// Puts `keys` with `sizes[i]` bytes each, written in place by `filler` (see the module
    /// docs). Per key: Ok, the store's refusal (-200 no space, ...), or the filler's error
    /// (the key is then revoked and stays invisible).
    pub fn batch_put_filled(
        &self,
        tenant: &Tenant,
        keys: &[String],
        sizes: &[u64],
        filler: &mut dyn Filler,
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> BatchResult<()> {
        cfg.validate()?;
        self.inner.cfg.check_batch(keys.len())?;
        if keys.len() != sizes.len() {
            return Err(L3Error::InvalidParams(
                "keys and sizes differ in length".into(),
            ));
        }
        let t0 = Instant::now();
        let handles: Vec<L3Result<PutHandle>> = keys
            .iter()
            .zip(sizes)
            .map(|(k, &s)| self.inner.put_start(tenant, k, s, cfg.replica_num))
            .collect();
        // Allocated first to last, ended last to first, as `batch_put_from_with`.
        let out = crate::batch_order::last_to_first(handles.len(), |i| {
            let h = handles[i].as_ref().map_err(Clone::clone)?;
            let bytes = usize::try_from(h.size)
                .map_err(|_| L3Error::InvalidParams("object too big".into()))
                .and_then(|len| {
                    let recycled = self.inner.master.lock().take_buffer(h.size);
                    // SAFETY: `Filler`'s contract: an Ok fill initialised every byte.
                    unsafe { buffers::fill_with(recycled, len, |dst| filler.fill(i, dst)) }
                });
            self.inner.put_finish_bytes(h, bytes, opts)
        });
        self.inner.metrics.observe(Op::Put, t0.elapsed());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::L3Store;
    use crate::config::StoreConfig;

    struct Pattern(Vec<Option<u8>>);

    // SAFETY: an Ok fill writes every byte of `dst`.
    unsafe impl Filler for Pattern {
        fn fill(&mut self, i: usize, dst: &mut [MaybeUninit<u8>]) -> L3Result<()> {
            match self.0[i] {
                Some(b) => {
                    dst.fill(MaybeUninit::new(b));
                    Ok(())
                }
                None => Err(L3Error::InvalidParams("bad source".into())),
            }
        }
    }

    #[test]
    fn a_failed_fill_leaves_its_key_invisible_and_the_others_whole() {
        let s = EmbeddedStore::new(StoreConfig::default()).unwrap();
        let t = Tenant::new("t").unwrap();
        let keys: Vec<String> = ["a", "b", "c"].iter().map(|k| k.to_string()).collect();
        let mut f = Pattern(vec![Some(1), None, Some(3)]);
        let r = s
            .batch_put_filled(
                &t,
                &keys,
                &[5 << 20, 100, 1],
                &mut f,
                PutOptions::default(),
                ReplicateConfig::default(),
            )
            .unwrap();
        assert!(r[0].is_ok() && r[2].is_ok(), "{r:?}");
        assert!(matches!(r[1], Err(L3Error::InvalidParams(_))));
        assert_eq!(s.get(&t, "a").unwrap(), vec![1u8; 5 << 20]);
        assert!(matches!(s.get(&t, "b"), Err(L3Error::ObjectNotFound)));
        assert_eq!(s.get(&t, "c").unwrap(), vec![3u8]);
        // The revoked key can be put again.
        let mut f = Pattern(vec![Some(2)]);
        let r = s
            .batch_put_filled(
                &t,
                &keys[1..2],
                &[100],
                &mut f,
                PutOptions::default(),
                ReplicateConfig::default(),
            )
            .unwrap();
        assert!(r[0].is_ok());
        assert_eq!(s.get(&t, "b").unwrap(), vec![2u8; 100]);
    }
}
