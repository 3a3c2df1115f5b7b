//! Which requests name a LoRA adapter, for the proxy.
//!
//! Why: an engine keys a LoRA request's KV blocks by the adapter too (vLLM's `BlockStored`
//! carries `lora_name`, and its block hashes are seeded by it), so a prompt cached under an
//! adapter is a miss for the base model and for every other adapter. The router must route
//! the request with the same key, or it credits an instance with pages the request cannot
//! use.
//!
//! How the name is found:
//! - vLLM: a request selects an adapter by its `model` field. Which names are adapters is in
//!   the server's `/v1/models` listing (an adapter's card has a `parent`, the base model's
//!   none). The listing is read from an instance on the first request naming a model the
//!   router does not know, and again for an unknown name at most every
//!   [`REFRESH`] (adapters can be loaded at run time).
//! - SGLang: a request names its adapter in `lora_path`.
//!
//! A name the listing does not know routes as the base model: the worst case is a worse
//! instance choice, never a failed request.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The least time between two readings of `/v1/models` for names not known.
pub const REFRESH: Duration = Duration::from_secs(10);

/// What a request's `model` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelKind {
    Base,
    Adapter,
}

/// The model names the instances serve, learnt from their `/v1/models`.
#[derive(Debug, Default)]
pub struct ModelNames {
    bases: HashSet<String>,
    adapters: HashSet<String>,
    read_at: Option<Instant>,
}

impl ModelNames {
    /// What `model` is, if the listing read so far names it.
    pub fn kind(&self, model: &str) -> Option<ModelKind> {
        if self.adapters.contains(model) {
            Some(ModelKind::Adapter)
        } else if self.bases.contains(model) {
            Some(ModelKind::Base)
        } else {
            None
        }
    }

    /// Whether the listing may be read again now (never read, or [`REFRESH`] ago).
    pub fn may_read(&self, now: Instant) -> bool {
        self.read_at
            .is_none_or(|t| now.saturating_duration_since(t) >= REFRESH)
    }

    /// Notes a reading (or a failed try) at `now`.
    pub fn read_at(&mut self, now: Instant) {
        self.read_at = Some(now);
    }

    /// Learns the names of an OpenAI `/v1/models` listing (vLLM's: `data[].id`, and `parent`
    /// for an adapter). Returns how many cards it read; a body of another shape reads none.
    pub fn learn(&mut self, listing: &Value) -> usize {
        let Some(cards) = listing.get("data").and_then(Value::as_array) else {
            return 0;
        };
        let mut n = 0;
        for card in cards {
            let Some(id) = card.get("id").and_then(Value::as_str) else {
                continue;
            };
            let adapter = card
                .get("parent")
                .is_some_and(|p| p.as_str().is_some_and(|p| !p.is_empty()));
            if adapter {
                self.bases.remove(id);
                self.adapters.insert(id.to_owned());
            } else {
                self.adapters.remove(id);
                self.bases.insert(id.to_owned());
            }
            n += 1;
        }
        n
    }
}

impl ModelNames {
    /// An adapter was loaded through the router (`/v1/load_lora_adapter`, SGLang's
    /// `/load_lora_adapter`): `name` is an adapter from now, without waiting for a listing.
    pub fn loaded(&mut self, name: &str) {
        self.bases.remove(name);
        self.adapters.insert(name.to_owned());
    }

    /// An adapter was unloaded through the router: `name` is no longer known (a request
    /// naming it routes as the base model, and a later one reads the listing again).
    pub fn unloaded(&mut self, name: &str) {
        self.adapters.remove(name);
        self.read_at = None;
    }
}

/// The adapter a request names outright (SGLang's `lora_path`), if any.
pub fn named_adapter(request: &Value) -> Option<&str> {
    request
        .get("lora_path")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn adapters_are_the_cards_with_a_parent() {
        let mut m = ModelNames::default();
        let listing = json!({"object": "list", "data": [
            {"id": "meta-llama/Llama-3.1-8B", "object": "model", "root": "meta-llama/Llama-3.1-8B", "parent": null},
            {"id": "sql-lora", "object": "model", "root": "/loras/sql", "parent": "meta-llama/Llama-3.1-8B"},
        ]});
        assert_eq!(m.learn(&listing), 2);
        assert_eq!(m.kind("sql-lora"), Some(ModelKind::Adapter));
        assert_eq!(m.kind("meta-llama/Llama-3.1-8B"), Some(ModelKind::Base));
        assert_eq!(m.kind("other"), None);
        assert_eq!(
            m.learn(&json!({"error": "nope"})),
            0,
            "another shape reads nothing"
        );
        assert_eq!(m.learn(&json!({"data": [{"object": "model"}, 3]})), 0);
    }

    #[test]
    fn the_listing_is_read_again_only_after_the_refresh_time() {
        let mut m = ModelNames::default();
        let t = Instant::now();
        assert!(m.may_read(t));
        m.read_at(t);
        assert!(!m.may_read(t + REFRESH / 2));
        assert!(m.may_read(t + REFRESH));
    }

    #[test]
    fn an_adapter_loaded_or_unloaded_through_the_router_is_known_at_once() {
        let mut m = ModelNames::default();
        let t = Instant::now();
        m.read_at(t);
        m.learn(&json!({"data": [{"id": "sql"}]}));
        m.loaded("sql");
        assert_eq!(m.kind("sql"), Some(ModelKind::Adapter));
        m.unloaded("sql");
        assert_eq!(m.kind("sql"), None);
        assert!(m.may_read(t), "the listing may be read again");
    }

    #[test]
    fn sglang_names_its_adapter_in_lora_path() {
        assert_eq!(
            named_adapter(&json!({"lora_path": "sql", "prompt": "x"})),
            Some("sql")
        );
        assert_eq!(named_adapter(&json!({"lora_path": ""})), None);
        assert_eq!(named_adapter(&json!({"model": "m"})), None);
    }
}
