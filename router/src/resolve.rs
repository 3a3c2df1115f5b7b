//! Keys for blocks an event names by hash alone (`--keys tokens`).
//!
//! Why: in `--keys tokens` mode the router keys a block by its tokens, but two publishers
//! name blocks without them. A shared store (`kvtier-l3 --kv-events`) knows no tokens: it
//! publishes each object as the block hash the engines publish for the same chunk (for
//! kvtier's vLLM integration, the chunk's last block hash, as vLLM's offloading connector
//! names it). vLLM's offloading connector, with its self-describing events off (the
//! default), publishes each offloaded chunk as a placeholder: that one hash, `token_ids`
//! empty, `block_size` 0. Without this module the store's pages keyed nothing — a router in
//! front of vLLM could not see the shared L3 — and a placeholder failed its whole batch,
//! the GPU events of that engine step with it.
//!
//! How: an engine computed every block before any tier held a copy of it, so an instance's
//! stream named it with its tokens first, and that stream's table ([`crate::keys::Translator`]) keys it.
//! A token-less store of hash `h` covering `block_size` tokens is the run of
//! `block_size / page_size` blocks (at least one) ending at `h`, walked back through the
//! parents the table remembers:
//!
//! - on an instance's stream, through its own table (the placeholder's medium is added to
//!   the blocks it keys there, so its removal translates too);
//! - on the shared store's stream, through the first instance table that keys `h`; the run is
//!   copied into the store stream's own table (its removal must translate after every
//!   instance dropped the block). A hash no instance keys yet waits (bounded, in the store
//!   stream's table) and is resolved when an instance's batch first keys it: a router that
//!   starts, or an instance stream that replays, after the store's snapshot loses nothing.
//!
//! A run whose first blocks a table does not know is keyed as far as it is known: each key
//! published names a block the store holds, so the worst case is an L3 prefix priced short.

use kvtier_events::Medium;

use crate::cluster::{StreamState, Target};
use crate::index::IndexEvent;
use crate::keys::{Tokenless, Translated};

/// The blocks of `page_size` tokens a token-less store of `block_size` tokens names (at
/// least one: a placeholder's `block_size` is 0), at most the longest run a table records
/// (`u16::MAX`): the walk through parents stops there, whatever the event claims or a
/// publisher's parents loop through.
pub fn blocks_of(block_size: usize, page_size: usize) -> usize {
    block_size
        .checked_div(page_size)
        .unwrap_or(0)
        .clamp(1, usize::from(u16::MAX))
}

/// Keys `batch` (of stream `stream`) further: its token-less stores, and the pending stores of
/// the shared store's streams that its new keys resolve. Returns the events for the stream's
/// own target and those for the shared set (`Target::Storage`). `room(s)`: the bytes stream
/// `s`'s table may hold now.
pub(crate) fn resolve(
    streams: &mut [StreamState],
    stream: usize,
    batch: Translated,
    page_size: usize,
    room: &dyn Fn(&[StreamState], usize) -> usize,
) -> (Vec<IndexEvent>, Vec<IndexEvent>) {
    let Translated {
        mut events,
        tokenless,
        fresh,
    } = batch;
    let mut storage = Vec::new();
    let Some(target) = streams.get(stream).map(|s| s.target) else {
        return (events, storage);
    };
    match target {
        Target::Instance(_) => {
            if let Some(own) = streams[stream].translator.as_mut() {
                for t in &tokenless {
                    let run = own.run_ending_at(t.hash, blocks_of(t.block_size, page_size));
                    if run.is_empty() {
                        own.unkeyed += 1;
                        continue;
                    }
                    let hashes = own.store_run(t.medium, &run);
                    events.push(own.placed(true, t.medium, t.local, hashes));
                }
            }
            storage = resolve_pending(streams, stream, &fresh, room);
        }
        Target::Storage => {
            events.extend(store_tokenless(
                streams, stream, &tokenless, page_size, room,
            ));
        }
    }
    (events, storage)
}

/// The shared store's token-less stores, keyed through the instances' tables (or left
/// waiting for one).
fn store_tokenless(
    streams: &mut [StreamState],
    stream: usize,
    tokenless: &[Tokenless],
    page_size: usize,
    room: &dyn Fn(&[StreamState], usize) -> usize,
) -> Vec<IndexEvent> {
    let mut out = Vec::new();
    if tokenless.is_empty() {
        return out;
    }
    let bytes = room(streams, stream);
    let Some(mut own) = streams[stream].translator.take() else {
        return out;
    };
    own.set_max_bytes(bytes);
    for t in tokenless {
        let blocks = blocks_of(t.block_size, page_size);
        let keyed_by = streams.iter().find_map(|s| {
            let tr = s.translator.as_ref()?;
            (matches!(s.target, Target::Instance(_)) && tr.knows(t.hash)).then_some(tr)
        });
        match keyed_by {
            Some(tr) => {
                let run = tr.run_ending_at(t.hash, blocks);
                let hashes = own.store_run(t.medium, &run);
                out.push(IndexEvent::Stored {
                    medium: t.medium,
                    hashes,
                });
            }
            None => own.wait_for(t.hash, blocks),
        }
    }
    streams[stream].translator = Some(own);
    out
}

/// The pending stores of every shared store's stream that the hashes `fresh` (just keyed by
/// instance stream `stream`) resolve.
fn resolve_pending(
    streams: &mut [StreamState],
    stream: usize,
    fresh: &[u64],
    room: &dyn Fn(&[StreamState], usize) -> usize,
) -> Vec<IndexEvent> {
    let mut out = Vec::new();
    if fresh.is_empty() {
        return out;
    }
    for s in 0..streams.len() {
        if streams[s].target != Target::Storage
            || streams[s]
                .translator
                .as_ref()
                .is_none_or(|t| t.pending() == 0)
        {
            continue;
        }
        let bytes = room(streams, s);
        let Some(mut waiting) = streams[s].translator.take() else {
            continue;
        };
        waiting.set_max_bytes(bytes);
        if let Some(keyed_by) = streams[stream].translator.as_ref() {
            for &h in fresh {
                if let Some(blocks) = waiting.take_pending(h) {
                    let run = keyed_by.run_ending_at(h, blocks);
                    let hashes = waiting.store_run(Medium::Storage, &run);
                    out.push(IndexEvent::Stored {
                        medium: Medium::Storage,
                        hashes,
                    });
                }
            }
        }
        streams[s].translator = Some(waiting);
    }
    out
}
