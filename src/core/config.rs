//! The core's configuration and its growth policy.

use super::align::{align_up, is_pow2};
use super::error::AllocError;
use super::types::{Growth, SizeClass};
use serde::{Deserialize, Serialize};

/// One mebibyte, for readable defaults.
const MIB: u64 = 1 << 20;

/// The smallest small segment of [`CoreConfig::registered()`]: 32 MiB, so that a few
/// hundred small live blocks take a few registered segments, not one each (48 MiB
/// would take the Llama-like trace of `tests/fsdp_trace.rs` past its 1.15 floor).
const REGISTERED_SMALL_SEGMENT_BYTES: u64 = 32 * MIB;

/// The largest segment (and request) the core handles: 16 TiB, so that sizes and
/// offsets fit the free index's packed keys.
pub const MAX_SEGMENT_BYTES: u64 = 1 << super::free_index::SIZE_BITS;

/// Sizes that steer rounding, splitting and growth.
///
/// Defaults follow PyTorch's caching allocator (`kMinBlockSize`, `kSmallSize`,
/// `kSmallBuffer`, `kLargeBuffer`, `kMinLargeAlloc`, `kRoundLarge`) with the segment
/// granularity of NCCL's `ncclMemAlloc` on H200 (2 MiB,
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`).
///
/// # Growth policy
///
/// When no free block of the request's size class fits, the core asks for one new
/// segment ([`Growth`]) for the request (rounded up to `min_block_bytes`):
///
/// | request | class | [`GrowthPolicy::Caching`] ([`default()`](Self::default)) | [`GrowthPolicy::Registered`] ([`registered()`](Self::registered)) |
/// |---|---|---|---|
/// | ≤ `small_request_max_bytes` | small | `small_segment_bytes` | `small_chunk` |
/// | ≤ `dedicated_min_bytes` | large | `large_segment_bytes` | `max(chunk, fit)` |
/// | larger | large | `fit`, dedicated | `max(chunk, fit)` |
///
/// - `fit`: the request rounded up to a multiple of `max(granularity_bytes,
///   2^⌊log2 request⌋ / dedicated_round_steps)` (at most 6.25 % more with the default
///   16 steps, so that requests of nearby sizes, a 250 MiB embedding and 255 MiB MLP
///   blocks, share segments); under the registered policy, requests up to
///   `dedicated_min_bytes` only to `granularity_bytes`.
/// - `chunk = clamp(⌈allocated · growth_percent / 100⌉, min_chunk_bytes,
///   max_chunk_bytes)` rounded up to `granularity_bytes`, `allocated` being the bytes
///   of the class's live blocks when the request misses; `small_chunk` the same
///   between `small_segment_bytes` and `max(max_chunk_bytes, small_segment_bytes)`.
///
/// The registered policy is for memory whose segments are expensive (registered
/// collectively with NCCL, each taking symmetric address space on every peer): every
/// segment is shared (best fit, no dedicated-segment rule), and the chunk grows with
/// the live data, not with what is reserved, so the over-reserve of earlier growths
/// does not compound. With its defaults each growth adds at least half of what the
/// class has live: the segments of a class stay logarithmic in its peak working set,
/// and right after a growth a class reserves at most about 1.5 times its live bytes
/// (plus fragments). 1 000 live tensors of 64 KiB–4 MiB (2 GiB) take 8 segments, 1.07
/// × their bytes (`tests/pool_small_growth.rs`). The defaults come from a sweep over
/// the FSDP-like traces of `tests/fsdp_trace.rs` (figures in `BENCHMARKS.md`).
///
/// Small requests never touch large segments, so they cannot pin one; a large request
/// of a few MiB can keep a big shared segment from being trimmed, which is what
/// [`Allocator::plan_fit_to_peak`](super::Allocator::plan_fit_to_peak) is for. Growth
/// past `max_reserved_bytes` fails with [`AllocError::OutOfMemory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CoreConfig {
    /// Every block size and offset is a multiple of this (default 512 B, a power of two).
    /// It is also the default alignment.
    pub min_block_bytes: u64,
    /// Segment sizes are multiples of this, and it is the largest alignment a request
    /// may ask for (default 2 MiB, a power of two).
    pub granularity_bytes: u64,
    /// Requests up to this size are small (default 1 MiB).
    pub small_request_max_bytes: u64,
    /// Size of each small segment (default 2 MiB).
    pub small_segment_bytes: u64,
    /// Size of a shared large segment (default 20 MiB).
    pub large_segment_bytes: u64,
    /// Large requests above this get a dedicated segment of their own size
    /// (default 10 MiB).
    pub dedicated_min_bytes: u64,
    /// A large free block is split only if the remainder is at least this big
    /// (default 1 MiB); otherwise the whole block is handed out.
    pub large_split_min_bytes: u64,
    /// A request may use a block of a dedicated segment only if it is at least
    /// 1/`dedicated_reuse_ratio` of the segment's size (default 4; 0 disables the rule;
    /// 1 is refused: a dedicated segment is rounded up past the request that caused it).
    pub dedicated_reuse_ratio: u64,
    /// Dedicated segments are rounded up to 1/`dedicated_round_steps` of their power
    /// of two (default 16; a power of two; 0 rounds to the granularity only).
    pub dedicated_round_steps: u64,
    /// Requests above this are refused with [`AllocError::TooLarge`] (default 1 TiB,
    /// at most [`MAX_SEGMENT_BYTES`], 16 TiB).
    pub max_request_bytes: u64,
    /// Growth beyond this many reserved bytes is refused with
    /// [`AllocError::OutOfMemory`] (default `u64::MAX`, no limit).
    pub max_reserved_bytes: u64,
    /// How segments are sized (default [`GrowthPolicy::Caching`], also when absent
    /// from older serialised configs).
    #[serde(default)]
    pub growth: GrowthPolicy,
}

/// How the core sizes new segments (see the table of [`CoreConfig`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum GrowthPolicy {
    /// PyTorch's caching-allocator policy: shared `large_segment_bytes` segments, and a
    /// dedicated segment of about its own size for every request over
    /// `dedicated_min_bytes`.
    #[default]
    Caching,
    /// For registered (symmetric) memory, where every segment is expensive: a new
    /// segment is at least a chunk that grows with its size class's live bytes.
    Registered {
        /// Smallest new large segment, in bytes (default 448 MiB; a non-zero multiple
        /// of `granularity_bytes`).
        min_chunk_bytes: u64,
        /// Largest chunk, in bytes (default 4 GiB; at least `min_chunk_bytes`, a
        /// multiple of `granularity_bytes`); a larger request still gets its fit.
        max_chunk_bytes: u64,
        /// A chunk is this percentage of the bytes the request's class has allocated
        /// (live blocks) when the request misses (default 50; at most 10 000).
        growth_percent: u64,
        /// Extra room of the segment that
        /// [`Allocator::plan_fit_to_peak`](super::Allocator::plan_fit_to_peak) plans,
        /// in percent of the observed peak (default 10, at most 100), against
        /// fragmentation when the next step's placement differs from the observed one.
        fit_headroom_percent: u64,
    },
}

impl GrowthPolicy {
    /// The registered policy with its defaults: 448 MiB minimum chunk, 4 GiB maximum
    /// chunk, 50 % growth, 10 % fit headroom.
    pub fn registered() -> Self {
        GrowthPolicy::Registered {
            min_chunk_bytes: 448 * MIB,
            max_chunk_bytes: 4096 * MIB,
            growth_percent: 50,
            fit_headroom_percent: 10,
        }
    }

    /// Whether this is the registered policy.
    pub fn is_registered(&self) -> bool {
        matches!(self, GrowthPolicy::Registered { .. })
    }
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            min_block_bytes: 512,
            granularity_bytes: 2 * MIB,
            small_request_max_bytes: MIB,
            small_segment_bytes: 2 * MIB,
            large_segment_bytes: 20 * MIB,
            dedicated_min_bytes: 10 * MIB,
            large_split_min_bytes: MIB,
            dedicated_reuse_ratio: 4,
            dedicated_round_steps: 16,
            max_request_bytes: 1 << 40,
            max_reserved_bytes: u64::MAX,
            growth: GrowthPolicy::Caching,
        }
    }
}

impl CoreConfig {
    /// The default sizes with [`GrowthPolicy::registered()`] and 32 MiB as the smallest
    /// small segment: what a pool whose segments are registered with NCCL should use.
    pub fn registered() -> Self {
        CoreConfig {
            small_segment_bytes: REGISTERED_SMALL_SEGMENT_BYTES,
            growth: GrowthPolicy::registered(),
            ..CoreConfig::default()
        }
    }

    /// Set the chunk bounds of the registered policy, in bytes. The policy becomes
    /// [`GrowthPolicy::Registered`] (with default percentages) if it was not already.
    pub fn with_chunk_bytes(self, min_chunk_bytes: u64, max_chunk_bytes: u64) -> Self {
        self.with_registered(|lo, hi, _, _| (*lo, *hi) = (min_chunk_bytes, max_chunk_bytes))
    }

    /// Set the growth percentage of the registered policy (100: a new chunk as large
    /// as the class's allocated bytes). The policy becomes
    /// [`GrowthPolicy::Registered`] if it was not already.
    pub fn with_growth_percent(self, percent: u64) -> Self {
        self.with_registered(|_, _, growth, _| *growth = percent)
    }

    /// Set the headroom of [`Allocator::plan_fit_to_peak`](super::Allocator::plan_fit_to_peak)
    /// under the registered policy, in percent of the observed peak. The policy becomes
    /// [`GrowthPolicy::Registered`] if it was not already.
    pub fn with_fit_headroom_percent(self, percent: u64) -> Self {
        self.with_registered(|_, _, _, headroom| *headroom = percent)
    }

    /// Change the registered policy's fields with `f` (in their order), the policy
    /// made [`GrowthPolicy::registered()`] first if it was another.
    fn with_registered(mut self, f: impl FnOnce(&mut u64, &mut u64, &mut u64, &mut u64)) -> Self {
        if !self.growth.is_registered() {
            self.growth = GrowthPolicy::registered();
        }
        if let GrowthPolicy::Registered {
            min_chunk_bytes,
            max_chunk_bytes,
            growth_percent,
            fit_headroom_percent,
        } = &mut self.growth
        {
            f(
                min_chunk_bytes,
                max_chunk_bytes,
                growth_percent,
                fit_headroom_percent,
            );
        }
        self
    }

    setters! {
        /// The largest small request and the small segment size, in bytes.
        with_small(small_request_max_bytes: u64, small_segment_bytes: u64);
        with_growth(growth: GrowthPolicy);
        with_granularity_bytes(granularity_bytes: u64);
        with_large_segment_bytes(large_segment_bytes: u64);
        with_dedicated_min_bytes(dedicated_min_bytes: u64);
        with_max_request_bytes(max_request_bytes: u64);
        with_max_reserved_bytes(max_reserved_bytes: u64);
    }

    /// Check that the sizes are consistent.
    ///
    /// # Errors
    /// [`AllocError::Config`] naming the first rule broken: `min_block_bytes` and
    /// `granularity_bytes` powers of two with `min_block_bytes ≤ granularity_bytes`;
    /// segment sizes non-zero multiples of the granularity; a small request fits a
    /// small segment; `dedicated_min_bytes ≤ large_segment_bytes`;
    /// `small_request_max_bytes < max_request_bytes`; `dedicated_reuse_ratio` 0 or at
    /// least 2; under [`GrowthPolicy::Registered`], chunk sizes non-zero multiples of the
    /// granularity with `min_chunk_bytes ≤ max_chunk_bytes ≤ 16 TiB`,
    /// `growth_percent ≤ 10 000` and `fit_headroom_percent ≤ 100`.
    pub fn validate(&self) -> Result<(), AllocError> {
        let bad = |what: &'static str| Err(AllocError::Config(what));
        if !is_pow2(self.min_block_bytes) || !is_pow2(self.granularity_bytes) {
            return bad("min_block_bytes and granularity_bytes must be powers of two");
        }
        if self.min_block_bytes > self.granularity_bytes {
            return bad("min_block_bytes must not exceed granularity_bytes");
        }
        for seg in [self.small_segment_bytes, self.large_segment_bytes] {
            if seg == 0 || !seg.is_multiple_of(self.granularity_bytes) {
                return bad("segment sizes must be non-zero multiples of granularity_bytes");
            }
        }
        if self.small_request_max_bytes == 0
            || !self
                .small_request_max_bytes
                .is_multiple_of(self.min_block_bytes)
            || self.small_request_max_bytes > self.small_segment_bytes
        {
            return bad(
                "small_request_max_bytes must be a non-zero multiple of min_block_bytes that fits a small segment",
            );
        }
        if self.dedicated_min_bytes > self.large_segment_bytes
            || self.dedicated_min_bytes < self.small_request_max_bytes
        {
            return bad(
                "dedicated_min_bytes must lie between small_request_max_bytes and large_segment_bytes",
            );
        }
        if self.dedicated_round_steps != 0 && !is_pow2(self.dedicated_round_steps) {
            return bad("dedicated_round_steps must be 0 or a power of two");
        }
        if self.dedicated_reuse_ratio == 1 {
            return bad("dedicated_reuse_ratio must be 0 or at least 2");
        }
        if self.max_request_bytes > MAX_SEGMENT_BYTES {
            return bad("max_request_bytes must not exceed 16 TiB");
        }
        if self.max_request_bytes <= self.small_request_max_bytes {
            return bad("max_request_bytes must exceed small_request_max_bytes");
        }
        if let GrowthPolicy::Registered {
            min_chunk_bytes,
            max_chunk_bytes,
            growth_percent,
            fit_headroom_percent,
        } = self.growth
        {
            if min_chunk_bytes == 0
                || !min_chunk_bytes.is_multiple_of(self.granularity_bytes)
                || !max_chunk_bytes.is_multiple_of(self.granularity_bytes)
                || min_chunk_bytes > max_chunk_bytes
                || max_chunk_bytes > MAX_SEGMENT_BYTES
            {
                return bad(
                    "chunk sizes must be non-zero multiples of granularity_bytes with min ≤ max ≤ 16 TiB",
                );
            }
            if growth_percent > 10_000 {
                return bad("growth_percent must not exceed 10 000");
            }
            if fit_headroom_percent > 100 {
                return bad("fit_headroom_percent must not exceed 100");
            }
        }
        Ok(())
    }

    /// The size class of a request already rounded to `min_block_bytes`.
    pub fn class_of(&self, rounded_bytes: u64) -> SizeClass {
        if rounded_bytes <= self.small_request_max_bytes {
            SizeClass::Small
        } else {
            SizeClass::Large
        }
    }

    /// Round a request up to the block size unit and check it against the limits.
    ///
    /// # Errors
    /// [`AllocError::ZeroSize`] for 0; [`AllocError::TooLarge`] above
    /// `max_request_bytes` (including sizes whose rounding would overflow `u64`).
    pub fn round_request(&self, size_bytes: u64) -> Result<u64, AllocError> {
        if size_bytes == 0 {
            return Err(AllocError::ZeroSize);
        }
        let too_large = AllocError::TooLarge {
            requested_bytes: size_bytes,
            max_bytes: self.max_request_bytes,
        };
        if size_bytes > self.max_request_bytes {
            return Err(too_large);
        }
        align_up(size_bytes, self.min_block_bytes).ok_or(too_large)
    }

    /// The segment the growth policy asks for, for a rounded request of `rounded_bytes`
    /// (at any alignment: offset 0 of a segment satisfies every alignment up to the
    /// granularity, so the request alone decides the size), when the live blocks of the
    /// request's size class take `class_allocated_bytes` (only the registered policy
    /// looks at it; 0 for a class that has allocated nothing; the allocator passes
    /// [`Allocator::class_allocated_bytes`](super::Allocator::class_allocated_bytes) of
    /// the request's class).
    ///
    /// # Errors
    /// [`AllocError::TooLarge`] if rounding to the granularity overflows.
    pub fn growth_with(
        &self,
        rounded_bytes: u64,
        class_allocated_bytes: u64,
    ) -> Result<Growth, AllocError> {
        let class = self.class_of(rounded_bytes);
        let too_large = || AllocError::TooLarge {
            requested_bytes: rounded_bytes,
            max_bytes: self.max_request_bytes,
        };
        let to_granularity = |bytes| align_up(bytes, self.granularity_bytes).ok_or_else(too_large);
        let dedicated = || self.dedicated_size(rounded_bytes).ok_or_else(too_large);
        let shared = rounded_bytes <= self.dedicated_min_bytes;
        let segment_bytes = match self.growth {
            GrowthPolicy::Caching => match class {
                SizeClass::Small => self.small_segment_bytes,
                SizeClass::Large if shared => self.large_segment_bytes,
                SizeClass::Large => dedicated()?,
            },
            GrowthPolicy::Registered {
                min_chunk_bytes,
                max_chunk_bytes,
                growth_percent,
                ..
            } => {
                let chunk = self.chunk(class_allocated_bytes, growth_percent);
                let floor = self.small_segment_bytes;
                match class {
                    // A small request fits `small_segment_bytes` (validated), the floor.
                    SizeClass::Small => {
                        to_granularity(chunk.clamp(floor, max_chunk_bytes.max(floor)))?
                    }
                    SizeClass::Large => {
                        let fit = if shared {
                            to_granularity(rounded_bytes)?
                        } else {
                            dedicated()?
                        };
                        // max_chunk_bytes is a multiple of the granularity: no overflow.
                        to_granularity(chunk.clamp(min_chunk_bytes, max_chunk_bytes))?.max(fit)
                    }
                }
            }
        };
        Ok(Growth {
            class,
            segment_bytes,
        })
    }

    /// `⌈allocated_bytes · growth_percent / 100⌉`, saturating.
    fn chunk(&self, allocated_bytes: u64, growth_percent: u64) -> u64 {
        let grown = u128::from(allocated_bytes) * u128::from(growth_percent);
        u64::try_from(grown.div_ceil(100)).unwrap_or(u64::MAX)
    }

    /// A dedicated segment's size for a large request: rounded up to a multiple of
    /// `max(granularity_bytes, 2^⌊log2 request⌋ / dedicated_round_steps)`; `None` on
    /// overflow.
    fn dedicated_size(&self, rounded_bytes: u64) -> Option<u64> {
        let octave = 1u64 << (63 - rounded_bytes.leading_zeros());
        let step = match self.dedicated_round_steps {
            0 => self.granularity_bytes,
            n => (octave / n).max(self.granularity_bytes),
        };
        align_up(rounded_bytes, step)
    }
}
