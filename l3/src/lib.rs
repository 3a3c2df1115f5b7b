//! kvtier-l3 (placeholder)
