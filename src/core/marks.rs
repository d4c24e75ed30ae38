//! What a [`Snapshot`](super::Snapshot) does not say about a block, for observers: the
//! allocation's sequence number and whether a free block is still fenced.

use super::allocator::{Allocator, Block, BlockUse};

/// Per block of [`Allocator::snapshot`], what only the allocator knows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockMark {
    /// The allocation's sequence number ([`BlockId::seq`](super::BlockId)) of an
    /// allocated block; `None` for a free one.
    pub(crate) allocation_seq: Option<u64>,
    /// A free block carrying a fence not yet reported complete (its memory may still be
    /// in use by device work); `false` for allocated blocks.
    pub(crate) fenced: bool,
}

impl Allocator {
    /// One mark per block, in the order of [`snapshot`](Self::snapshot): segments in
    /// id order, blocks in address order (`marks[i][j]` belongs to
    /// `snapshot.segments[i].blocks[j]`).
    pub(crate) fn block_marks(&self) -> Vec<Vec<BlockMark>> {
        self.segments
            .values()
            .map(|seg| {
                let mark = |b: &Block| match &b.usage {
                    BlockUse::Allocated { seq, .. } => BlockMark {
                        allocation_seq: Some(*seq),
                        fenced: false,
                    },
                    BlockUse::Free { fenced, .. } => BlockMark {
                        allocation_seq: None,
                        fenced: *fenced,
                    },
                };
                self.blocks_of(seg).map(mark).collect()
            })
            .collect()
    }
}
