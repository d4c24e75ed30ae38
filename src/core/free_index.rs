//! The ordered free index of one size class: logically the set of its free blocks
//! ordered by (size, segment, offset), where [`find_first`](FreeIndex::find_first)
//! returns the smallest key at or above a start key that a predicate accepts.
//! Physically the keys are spread over bins by size, TLSF-style (32 bins per power of
//! two), each an ordered set, with a bitmap of the non-empty bins; bin order followed
//! by key order is the logical order. An alloc + free pair walks shallow trees (one
//! leaf, usually).

use super::allocator::FreeKey;
use super::types::SegmentId;
use std::collections::{BTreeMap, BTreeSet};

/// Offsets fit in this many bits and sizes are at most `1 << SIZE_BITS` (16 TiB;
/// `CoreConfig::validate` and `add_segment` keep them there), so a key packs into one
/// `u128` whose integer order is the tuple's order: one wide comparison instead of
/// three. The size takes the top 52 bits.
pub(super) const SIZE_BITS: u32 = 44;

/// (size, segment, offset) packed; the slot rides along as the map's value (it never
/// decides order, since (segment, offset) is unique).
#[inline]
fn pack(k: &FreeKey) -> u128 {
    debug_assert!(
        k.0 >> (96 - SIZE_BITS) == 0 && k.2 >> SIZE_BITS == 0,
        "key out of range"
    );
    (u128::from(k.0) << (32 + SIZE_BITS)) | (u128::from(k.1.0) << SIZE_BITS) | u128::from(k.2)
}

#[inline]
fn unpack(p: u128, slot: u32) -> FreeKey {
    let mask = (1u128 << SIZE_BITS) - 1;
    (
        (p >> (32 + SIZE_BITS)) as u64,
        SegmentId((p >> SIZE_BITS) as u32),
        (p & mask) as u64,
        slot,
    )
}

/// log2 of the bins per power of two.
const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;
/// Number of bins: sizes below 2·SUB get one bin each, then SUB bins per power of two.
const BINS: usize = (SUB as usize) * (64 - SUB_BITS as usize + 1);
const WORDS: usize = BINS.div_ceil(64);
/// Bins with at most this many keys are scanned from their first key, which is
/// cheaper than a range search.
const LINEAR_SCAN: usize = 16;

/// The bin of a size: non-decreasing in `size`.
#[inline]
fn bin_of(size: u64) -> usize {
    let log2 = 63 - size.max(1).leading_zeros();
    if log2 < SUB_BITS {
        size as usize
    } else {
        let sub = (size >> (log2 - SUB_BITS)) & (SUB - 1);
        (SUB as usize) * (log2 - SUB_BITS + 1) as usize + sub as usize
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct FreeIndex {
    /// Bin `i` holds the (packed) keys whose size maps to `i`; grown on demand.
    bins: Vec<BTreeMap<u128, u32>>,
    /// Bit `i` is set when bin `i` is non-empty.
    nonempty: [u64; WORDS],
}

// The methods (and helpers) on the alloc and free path are `#[inline]`, like
// `Allocator::find_fit`: without it, whether they are inlined into `Allocator::alloc`,
// `carve` and `free` depends on how rustc splits the crate into codegen units, which
// unrelated code changes. (The growth-policy commits left `find_first`, `insert` and
// `remove` out of line in the `cargo bench` build, with the predicate called through a
// `&mut FnMut` shim: +4.5 % instructions and about 15 % time on the alloc + free pair.)
impl FreeIndex {
    /// Add a key that is not in the index.
    #[inline]
    pub(super) fn insert(&mut self, key: FreeKey) {
        let b = bin_of(key.0);
        if self.bins.len() <= b {
            self.bins.resize_with(b + 1, BTreeMap::new);
        }
        self.bins[b].insert(pack(&key), key.3);
        self.nonempty[b / 64] |= 1 << (b % 64);
    }

    /// Remove a key; `false` if it was not in the index.
    #[inline]
    pub(super) fn remove(&mut self, key: &FreeKey) -> bool {
        let b = bin_of(key.0);
        let Some(bin) = self.bins.get_mut(b) else {
            return false;
        };
        let removed = bin.remove(&pack(key)).is_some();
        if bin.is_empty() {
            self.nonempty[b / 64] &= !(1 << (b % 64));
        }
        removed
    }

    /// Every key, in order.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = FreeKey> + '_ {
        self.bins
            .iter()
            .flat_map(|b| b.iter().map(|(&p, &slot)| unpack(p, slot)))
    }

    /// The first non-empty bin after `b`.
    #[inline]
    fn next_bin(&self, b: usize) -> Option<usize> {
        let mut b = b + 1;
        while b < BINS {
            let word = self.nonempty[b / 64] >> (b % 64);
            if word != 0 {
                return Some(b + word.trailing_zeros() as usize);
            }
            b = (b / 64 + 1) * 64;
        }
        None
    }

    /// The smallest key `k ≥ start` for which `fit(k)` is `Some`, with that value.
    #[inline]
    pub(super) fn find_first<T>(
        &self,
        start: FreeKey,
        mut fit: impl FnMut(&FreeKey) -> Option<T>,
    ) -> Option<(FreeKey, T)> {
        let first = bin_of(start.0);
        let p = pack(&start);
        // Plain loops calling `fit` directly (no `&mut` closure adapters), so that the
        // predicate inlines into the caller.
        if let Some(bin) = self.bins.get(first) {
            if bin.len() <= LINEAR_SCAN {
                for (&q, &slot) in bin {
                    if q >= p {
                        let k = unpack(q, slot);
                        if let Some(t) = fit(&k) {
                            return Some((k, t));
                        }
                    }
                }
            } else {
                for (&q, &slot) in bin.range(p..) {
                    let k = unpack(q, slot);
                    if let Some(t) = fit(&k) {
                        return Some((k, t));
                    }
                }
            }
        }
        let mut b = first;
        loop {
            b = self.next_bin(b)?;
            // Every key of a later bin is larger than `start`.
            for (&q, &slot) in &self.bins[b] {
                let k = unpack(q, slot);
                if let Some(t) = fit(&k) {
                    return Some((k, t));
                }
            }
        }
    }

    /// Total size of the free blocks in the index. O(keys): for statistics and plans,
    /// never for the alloc or free path.
    pub(super) fn total_bytes(&self) -> u64 {
        self.bins
            .iter()
            .flat_map(|bin| bin.keys())
            .map(|&p| (p >> (32 + SIZE_BITS)) as u64)
            .sum()
    }

    /// The keys of the bins the bitmap marks, as one ordered set, or what is wrong
    /// with them. A non-empty bin the bitmap misses leaves its keys out of the set,
    /// which the caller's comparison with the free blocks catches. O(bins + keys).
    pub(super) fn to_set(&self) -> Result<BTreeSet<FreeKey>, &'static str> {
        let mut all = BTreeSet::new();
        for b in (0..BINS).filter(|&b| self.nonempty[b / 64] >> (b % 64) & 1 != 0) {
            match self.bins.get(b) {
                Some(bin) if !bin.is_empty() => {
                    let keys = bin.iter().map(|(&p, &slot)| unpack(p, slot));
                    if keys.clone().any(|k| bin_of(k.0) != b) {
                        return Err("free index key in the wrong bin");
                    }
                    all.extend(keys);
                }
                _ => return Err("free index bitmap marks an empty bin"),
            }
        }
        Ok(all)
    }
}

#[cfg(test)]
#[path = "../../tests/unit/core/free_index.rs"]
mod tests;
