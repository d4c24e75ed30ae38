//! symmpool: a deterministic symmetric-memory caching allocator for NCCL.

pub mod core;
