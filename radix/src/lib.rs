//! kvtier-radix (placeholder)
