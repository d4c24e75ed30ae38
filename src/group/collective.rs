//! The record of one collective (or of a step boundary), as the ranks compare it:
//! what the call is, on which buffers, on which communicator and at which sequence
//! number, with the names the divergence report gives its fields.

use super::record::{Fields, Value};
use serde::{Deserialize, Serialize};

/// What a record is of.
#[derive(Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub(crate) enum RecordKind {
    /// One collective.
    #[default]
    Collective,
    /// A step boundary ([`end_step`](crate::coll::Coll::end_step)): the pool's call
    /// count and hash, so that pool calls without collectives cannot drift unseen.
    Step,
}

/// The collective a record is of.
#[derive(Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub(crate) enum CollKind {
    /// No collective (a step record).
    #[default]
    None,
    AllGather,
    ReduceScatter,
    AllReduce,
}

/// One buffer of a collective: (allocation number, segment, offset, bytes).
#[derive(Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub(crate) struct BufferRecord {
    pub(crate) allocation: u64,
    pub(crate) segment: u32,
    pub(crate) offset_bytes: u64,
    pub(crate) len_bytes: u64,
}

/// One rank's record of one collective (or of a step boundary). `Copy`: posting one
/// allocates nothing.
#[derive(Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub(crate) struct CollectiveRecord {
    pub(crate) kind: RecordKind,
    /// The ordinal of the pool's exchange channel (its identity among the ranks).
    pub(crate) pool: u64,
    /// The caller's identity of the call ([`Coll::tagged`](crate::coll::Coll::tagged));
    /// `None` when untagged and for a step (every `u64`, 0 included, is a tag).
    pub(crate) tag: Option<u64>,
    /// Collectives issued on this pool so far.
    pub(crate) pool_collective: u64,
    pub(crate) collective: CollKind,
    /// The element type and reduction as their wire codes.
    pub(crate) dtype: Option<u8>,
    pub(crate) reduction: Option<u8>,
    pub(crate) count: u64,
    /// The communicator the path chose, and the collectives issued on it over every
    /// pool of the handle.
    pub(crate) comm: u64,
    pub(crate) comm_seq: u64,
    /// The path's number (`Path as u8`, see `coll::PATHS`); `None` for a step.
    pub(crate) path: Option<u8>,
    pub(crate) input: BufferRecord,
    pub(crate) output: BufferRecord,
    /// The pool's call count and running hash before the call.
    pub(crate) call_seq: u64,
    pub(crate) call_hash: u64,
}

// The names of the element types, reductions and paths by their wire codes: a
// `DType`, `ReduceOp` or `Path` `as u8` (see `coll::PATHS`).
const DTYPES: [&str; 4] = ["f32", "f16", "bf16", "u8"];
const REDUCTIONS: [&str; 5] = ["sum", "prod", "max", "min", "avg"];
const PATHS: [&str; 3] = ["copy engine", "symmetric kernel", "plain kernel"];

/// A wire code as its name in `names` (a code beyond them as its number; no code:
/// `none`).
fn named(names: &[&'static str], code: Option<u8>) -> Value {
    match code {
        None => Value::Name("none"),
        Some(c) => names
            .get(usize::from(c))
            .map_or(Value::Number(u64::from(c)), |s| Value::Name(s)),
    }
}

impl CollectiveRecord {
    /// A step-boundary record of the pool `pool` for the communicator `comm`: the
    /// collectives issued on the pool, the collectives the handle issued on `comm`
    /// (over every pool of the handle), and the pool's call count and hash.
    pub(crate) fn step(
        pool: u64,
        pool_collectives: u64,
        (comm, comm_collectives): (u64, u64),
        (call_seq, call_hash): (u64, u64),
    ) -> Self {
        CollectiveRecord {
            kind: RecordKind::Step,
            pool,
            pool_collective: pool_collectives,
            comm,
            comm_seq: comm_collectives,
            call_seq,
            call_hash,
            ..Default::default()
        }
    }
}

impl Fields for CollectiveRecord {
    const NAMES: &'static [&'static str] = &[
        "record kind",
        "pool (channel ordinal)",
        "tag",
        "pool collective number",
        "collective",
        "element type",
        "reduction",
        "count",
        "communicator",
        "communicator sequence number",
        "path",
        "input allocation",
        "input segment",
        "input offset",
        "input bytes",
        "output allocation",
        "output segment",
        "output offset",
        "output bytes",
        "pool call count",
        "pool call hash",
    ];

    fn field(&self, i: usize) -> Value {
        match i {
            0 => Value::Name(match self.kind {
                RecordKind::Collective => "collective",
                RecordKind::Step => "step boundary",
            }),
            1 => Value::Number(self.pool),
            2 => Value::Tag(self.tag),
            3 => Value::Number(self.pool_collective),
            4 => Value::Name(match self.collective {
                CollKind::None => "none (step boundary)",
                CollKind::AllGather => "all_gather",
                CollKind::ReduceScatter => "reduce_scatter",
                CollKind::AllReduce => "all_reduce",
            }),
            5 => named(&DTYPES, self.dtype),
            6 => named(&REDUCTIONS, self.reduction),
            7 => Value::Number(self.count),
            8 => Value::Number(self.comm),
            9 => Value::Number(self.comm_seq),
            10 => named(&PATHS, self.path),
            11..=18 => {
                let b = if i < 15 { &self.input } else { &self.output };
                let fields = [b.allocation, b.segment.into(), b.offset_bytes, b.len_bytes];
                Value::Number(fields[(i - 11) % 4])
            }
            19 => Value::Number(self.call_seq),
            _ => Value::Hex(self.call_hash),
        }
    }

    /// The record kind with where the rank is, so that a rank that skipped a
    /// collective (or made an extra one) is named in the message.
    fn describe(&self, i: usize) -> String {
        let n = self.pool_collective;
        match (i, self.kind) {
            (0, RecordKind::Collective) => {
                format!("a collective (this rank's collective #{n} on the pool)")
            }
            (0, RecordKind::Step) => format!("a step boundary (after {n} collectives on the pool)"),
            _ => self.field(i).show(),
        }
    }
}
