//! kvtier-fsm (placeholder)
