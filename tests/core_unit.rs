//! Unit tests of the core through its public API: rounding, exact fit, split,
//! coalescing, alignment, stale handles, size limits, streams and growth.

use symmpool::__core::*;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn core() -> Allocator {
    Allocator::new(CoreConfig::default()).unwrap()
}

/// Allocate, growing as the core asks. Checks invariants after each step.
fn alloc(c: &mut Allocator, req: AllocRequest) -> Placement {
    let p = match c.alloc(req) {
        Err(AllocError::NeedsGrowth(g)) => {
            c.add_segment(g).unwrap();
            c.check_invariants().unwrap();
            c.alloc(req).unwrap()
        }
        other => other.unwrap(),
    };
    c.check_invariants().unwrap();
    p
}

fn free(c: &mut Allocator, p: &Placement) {
    c.free(p.block, &[]).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn rounding_to_min_block() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(1, S0));
    assert_eq!(a.size_bytes, 512);
    let b = alloc(&mut c, AllocRequest::new(513, S0));
    assert_eq!(b.size_bytes, 1024);
    assert_eq!(b.offset_bytes, 512);
    assert_eq!(c.stats().requested_bytes.current, 514);
    assert_eq!(c.stats().allocated_bytes.current, 1536);
}

#[test]
fn zero_size_is_refused_and_never_grows() {
    let mut c = core();
    assert_eq!(c.alloc(AllocRequest::new(0, S0)), Err(AllocError::ZeroSize));
    assert_eq!(c.stats().num_growths, 0);
    assert_eq!(c.stats().num_misses, 0);
    c.check_invariants().unwrap();
}

#[test]
fn huge_sizes_are_errors_not_tiny_blocks() {
    let mut c = core();
    for size in [u64::MAX, u64::MAX - 1, u64::MAX - 511, (1 << 40) + 1] {
        assert!(
            matches!(
                c.alloc(AllocRequest::new(size, S0)),
                Err(AllocError::TooLarge { .. })
            ),
            "size {size}"
        );
    }
    // Exactly at the limit is a valid request (that needs growth).
    assert!(matches!(
        c.alloc(AllocRequest::new(1 << 40, S0)),
        Err(AllocError::NeedsGrowth(Growth {
            class: SizeClass::Large,
            segment_bytes
        })) if segment_bytes == 1 << 40
    ));
    c.check_invariants().unwrap();
}

#[test]
fn reserved_limit_gives_out_of_memory() {
    let mut c = Allocator::new(CoreConfig::default().with_max_reserved_bytes(24 * MIB)).unwrap();
    let _a = alloc(&mut c, AllocRequest::new(3 * MIB, S0));
    assert!(matches!(
        c.alloc(AllocRequest::new(18 * MIB, S0)),
        Err(AllocError::OutOfMemory { segment_bytes, would_reserve_bytes, max_reserved_bytes })
            if segment_bytes == 18 * MIB && would_reserve_bytes == 38 * MIB && max_reserved_bytes == 24 * MIB
    ));
    assert!(matches!(
        c.add_segment(Growth {
            class: SizeClass::Large,
            segment_bytes: 8 * MIB
        }),
        Err(AllocError::OutOfMemory { .. })
    ));
    c.check_invariants().unwrap();
}

#[test]
fn exact_fit_reuses_the_freed_block() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(4096, S0));
    let _b = alloc(&mut c, AllocRequest::new(4096, S0));
    free(&mut c, &a);
    let a2 = alloc(&mut c, AllocRequest::new(4096, S0));
    assert_eq!((a2.segment, a2.offset_bytes), (a.segment, a.offset_bytes));
    assert_eq!(c.stats().num_growths, 1);
}

#[test]
fn best_fit_prefers_the_smallest_block_then_lowest_address() {
    let mut c = core();
    let sizes = [8192, 512, 4096, 512, 2048, 512];
    let ps: Vec<_> = sizes
        .iter()
        .map(|&s| alloc(&mut c, AllocRequest::new(s, S0)))
        .collect();
    // Free the 8192, 4096 and 2048 blocks; the 512 separators keep them apart.
    for i in [0, 2, 4] {
        free(&mut c, &ps[i]);
    }
    let p = alloc(&mut c, AllocRequest::new(2000, S0));
    assert_eq!(p.offset_bytes, ps[4].offset_bytes, "smallest fitting block");
    let q = alloc(&mut c, AllocRequest::new(4096, S0));
    assert_eq!(q.offset_bytes, ps[2].offset_bytes);
}

#[test]
fn split_keeps_the_remainder_free() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(1024, S0));
    assert_eq!(a.offset_bytes, 0);
    assert_eq!(c.stats().num_splits, 1);
    assert_eq!(c.stats().free_blocks, 1);
    let snap = c.snapshot();
    assert_eq!(snap.segments[0].blocks.len(), 2);
    assert_eq!(snap.segments[0].blocks[1].offset_bytes, 1024);
    assert_eq!(snap.segments[0].blocks[1].size_bytes, 2 * MIB - 1024);
}

#[test]
fn large_blocks_do_not_split_off_small_remainders() {
    let mut c = core();
    // 19.5 MiB in a 20 MiB segment: the 0.5 MiB remainder is not worth a block.
    let a = alloc(&mut c, AllocRequest::new(19 * MIB + MIB / 2, S0));
    assert_eq!(a.size_bytes, 20 * MIB);
    assert_eq!(c.stats().free_blocks, 0);
    // 18 MiB leaves 2 MiB: split.
    free(&mut c, &a);
    let b = alloc(&mut c, AllocRequest::new(18 * MIB, S0));
    assert_eq!(b.size_bytes, 18 * MIB);
    assert_eq!(c.stats().free_blocks, 1);
}

#[test]
fn coalesces_with_both_neighbours() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(4096, S0));
    let b = alloc(&mut c, AllocRequest::new(4096, S0));
    let d = alloc(&mut c, AllocRequest::new(4096, S0));
    let _e = alloc(&mut c, AllocRequest::new(4096, S0));
    free(&mut c, &a);
    free(&mut c, &d);
    assert_eq!(c.stats().free_blocks, 3);
    free(&mut c, &b); // merges with a (left) and d (right)
    assert_eq!(c.stats().free_blocks, 2);
    assert_eq!(c.stats().num_merges, 2);
    let snap = c.snapshot();
    assert_eq!(snap.segments[0].blocks[0].size_bytes, 3 * 4096);
    assert_eq!(snap.segments[0].blocks[0].state, BlockState::Free);
}

#[test]
fn coalescing_after_everything_frees_restores_one_block() {
    let mut c = core();
    let ps: Vec<_> = (1..20)
        .map(|i| alloc(&mut c, AllocRequest::new(i * 1000, S0)))
        .collect();
    // Even indices from the top down, then odd ones from the bottom up.
    for p in ps
        .iter()
        .rev()
        .step_by(2)
        .chain(ps.iter().skip(1).step_by(2))
    {
        free(&mut c, p);
    }
    let snap = c.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].blocks.len(), 1);
}

#[test]
fn never_coalesces_across_segments() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(MIB, S0));
    let b = alloc(&mut c, AllocRequest::new(MIB, S0));
    let d = alloc(&mut c, AllocRequest::new(MIB, S0)); // third MiB: new small segment
    assert_eq!(a.segment, b.segment);
    assert_ne!(a.segment, d.segment);
    free(&mut c, &b);
    free(&mut c, &d);
    let snap = c.snapshot();
    assert_eq!(snap.segments[0].blocks.len(), 2);
    assert_eq!(snap.segments[1].blocks.len(), 1);
}

#[test]
fn alignment_edges() {
    let mut c = core();
    let _pad = alloc(&mut c, AllocRequest::new(512, S0));
    let a = alloc(&mut c, AllocRequest::new(512, S0).with_align(4096));
    assert_eq!(a.offset_bytes % 4096, 0);
    assert_eq!(a.offset_bytes, 4096);
    // The 3.5 KiB of padding in front stays usable.
    let b = alloc(&mut c, AllocRequest::new(3584, S0));
    assert_eq!(b.offset_bytes, 512);
    // Alignment 1 and 512 mean the default.
    let d = alloc(&mut c, AllocRequest::new(100, S0).with_align(1));
    assert_eq!(d.offset_bytes % 512, 0);
    // Largest alignment: the granularity.
    let e = alloc(&mut c, AllocRequest::new(512, S0).with_align(2 * MIB));
    assert_eq!(e.offset_bytes % (2 * MIB), 0);
    for bad in [0, 3, 1000, 4 * MIB, 1 << 63] {
        assert!(
            matches!(
                c.alloc(AllocRequest::new(512, S0).with_align(bad)),
                Err(AllocError::BadAlignment { .. })
            ),
            "alignment {bad}"
        );
    }
    c.check_invariants().unwrap();
}

#[test]
fn stale_and_double_free_are_errors() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(512, S0));
    free(&mut c, &a);
    assert_eq!(c.free(a.block, &[]), Err(AllocError::StaleBlock(a.block)));
    // The slot is reused by the next allocation; the old handle stays stale.
    let b = alloc(&mut c, AllocRequest::new(512, S0));
    assert_eq!(b.block.slot, a.block.slot);
    assert_eq!(c.free(a.block, &[]), Err(AllocError::StaleBlock(a.block)));
    assert_eq!(c.streams_of(a.block), Err(AllocError::StaleBlock(a.block)));
    assert_eq!(
        c.record_stream(a.block, S1),
        Err(AllocError::StaleBlock(a.block))
    );
    let foreign = BlockId { slot: 9999, seq: 1 };
    assert_eq!(c.free(foreign, &[]), Err(AllocError::StaleBlock(foreign)));
    c.check_invariants().unwrap();
    assert_eq!(c.stats().allocated_blocks.current, 1);
}

#[test]
fn small_requests_never_pin_a_large_segment() {
    let mut c = core();
    // alloc L, free, alloc small, alloc L: no new segment for the second L.
    let big = alloc(&mut c, AllocRequest::new(64 * MIB, S0));
    free(&mut c, &big);
    let small = alloc(&mut c, AllocRequest::new(4096, S0));
    let big2 = alloc(&mut c, AllocRequest::new(64 * MIB, S0));
    assert_ne!(small.segment, big2.segment);
    assert_eq!((big2.segment, big2.offset_bytes), (big.segment, 0));
    let segs: Vec<_> = c.segments().collect();
    assert_eq!(segs.len(), 2);
    assert_eq!(segs[1].1, SizeClass::Small);
}

#[test]
fn growth_policy_table() {
    let c = CoreConfig::default();
    let g = |size| c.growth_with(c.round_request(size).unwrap(), 0).unwrap();
    assert_eq!(
        g(1),
        Growth {
            class: SizeClass::Small,
            segment_bytes: 2 * MIB
        }
    );
    assert_eq!(
        g(MIB),
        Growth {
            class: SizeClass::Small,
            segment_bytes: 2 * MIB
        }
    );
    assert_eq!(
        g(MIB + 1),
        Growth {
            class: SizeClass::Large,
            segment_bytes: 20 * MIB
        }
    );
    assert_eq!(
        g(10 * MIB),
        Growth {
            class: SizeClass::Large,
            segment_bytes: 20 * MIB
        }
    );
    assert_eq!(
        g(10 * MIB + 1),
        Growth {
            class: SizeClass::Large,
            segment_bytes: 12 * MIB
        }
    );
    assert_eq!(
        g(255 * MIB + 3),
        Growth {
            class: SizeClass::Large,
            segment_bytes: 256 * MIB
        }
    );
    // 1/16 of the power of two: 250 MiB and 255 MiB requests share a 256 MiB segment.
    assert_eq!(
        g(250 * MIB),
        Growth {
            class: SizeClass::Large,
            segment_bytes: 256 * MIB
        }
    );
    assert_eq!(
        g(128 * MIB + 8192),
        Growth {
            class: SizeClass::Large,
            segment_bytes: 136 * MIB
        }
    );
    assert_eq!(
        g(1 << 40),
        Growth {
            class: SizeClass::Large,
            segment_bytes: 1 << 40
        }
    );
}

#[test]
fn bad_segment_sizes_are_refused() {
    let mut c = core();
    for size in [0, 512, 3 * MIB, u64::MAX] {
        assert!(matches!(
            c.add_segment(Growth {
                class: SizeClass::Large,
                segment_bytes: size
            }),
            Err(AllocError::BadSegmentSize { .. })
        ));
    }
    c.check_invariants().unwrap();
    assert_eq!(c.stats().segments.current, 0);
}

#[test]
fn invalid_configs_are_refused() {
    let base = CoreConfig::default();
    let mut bad = vec![
        base.with_granularity_bytes(3 << 20),
        base.with_large_segment_bytes(3 << 20),
        base.with_small(4 << 20, 2 << 20),
        base.with_dedicated_min_bytes(40 << 20),
        base.with_max_request_bytes(1024),
    ];
    let mut c = base;
    c.min_block_bytes = 1000;
    bad.push(c);
    for cfg in bad {
        assert!(
            matches!(Allocator::new(cfg), Err(AllocError::Config(_))),
            "{cfg:?}"
        );
    }
}

#[test]
fn same_stream_reuse_needs_no_wait() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(4096, S0));
    c.free(
        a.block,
        &[Wait {
            stream: S0,
            fence: Fence(1),
        }],
    )
    .unwrap();
    let b = alloc(&mut c, AllocRequest::new(4096, S0));
    assert!(b.waits.is_empty());
    // The stream's own fence comes along: a use on another stream waits for it.
    assert_eq!(b.own_fence, Some(Fence(1)));
    // Memory never used on the allocating stream has none.
    let fresh = alloc(&mut c, AllocRequest::new(4096, S1));
    assert_eq!(fresh.own_fence, None);
}

#[test]
fn cross_stream_reuse_returns_waits() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(4096, S0));
    c.record_stream(a.block, S1).unwrap();
    c.record_stream(a.block, S1).unwrap();
    c.record_stream(a.block, S0).unwrap();
    assert_eq!(c.streams_of(a.block).unwrap().as_slice(), &[S0, S1]);
    c.free(
        a.block,
        &[
            Wait {
                stream: S0,
                fence: Fence(7),
            },
            Wait {
                stream: S1,
                fence: Fence(3),
            },
        ],
    )
    .unwrap();
    c.check_invariants().unwrap();
    // Reused on stream 2: wait for both.
    let b = alloc(&mut c, AllocRequest::new(4096, StreamId(2)));
    assert_eq!(
        b.waits.as_slice(),
        &[
            Wait {
                stream: S0,
                fence: Fence(7)
            },
            Wait {
                stream: S1,
                fence: Fence(3)
            }
        ]
    );
    assert_eq!(c.stats().num_waits, 2);
    assert_eq!(b.own_fence, None);
    // Reused on stream 1: only stream 0's fence.
    c.free(
        b.block,
        &[Wait {
            stream: StreamId(2),
            fence: Fence(1),
        }],
    )
    .unwrap();
    let d = alloc(&mut c, AllocRequest::new(4096, S1));
    // The block merged back into the segment's free block, which keeps the fences
    // of everything that was freed into it.
    assert!(d.waits.contains(&Wait {
        stream: StreamId(2),
        fence: Fence(1)
    }));
    assert!(d.waits.iter().all(|w| w.stream != S1));
    assert_eq!(d.own_fence, Some(Fence(3)), "stream 1's own, kept apart");
    c.check_invariants().unwrap();
}

#[test]
fn merged_fences_keep_the_latest_per_stream() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(4096, S0));
    let b = alloc(&mut c, AllocRequest::new(4096, S0));
    let _guard = alloc(&mut c, AllocRequest::new(4096, S0));
    c.free(
        a.block,
        &[Wait {
            stream: S1,
            fence: Fence(5),
        }],
    )
    .unwrap();
    c.free(
        b.block,
        &[
            Wait {
                stream: S1,
                fence: Fence(9),
            },
            Wait {
                stream: S1,
                fence: Fence(2),
            },
        ],
    )
    .unwrap();
    c.check_invariants().unwrap();
    let d = alloc(&mut c, AllocRequest::new(8192, S0));
    assert_eq!(
        d.waits.as_slice(),
        &[Wait {
            stream: S1,
            fence: Fence(9)
        }]
    );
}

#[test]
fn fence_completion_only_moves_active_bytes() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(MIB, S0));
    let _b = alloc(&mut c, AllocRequest::new(MIB, S0));
    c.free(
        a.block,
        &[Wait {
            stream: S1,
            fence: Fence(4),
        }],
    )
    .unwrap();
    assert_eq!(c.stats().active_bytes.current, 2 * MIB);
    c.complete_fences(S1, Fence(3));
    assert_eq!(c.stats().active_bytes.current, 2 * MIB);
    c.complete_fences(S1, Fence(4));
    assert_eq!(c.stats().active_bytes.current, MIB);
    c.check_invariants().unwrap();
    // Waits are still reported: completion never changes what alloc returns.
    let d = alloc(&mut c, AllocRequest::new(MIB, S0));
    assert_eq!(
        d.waits.as_slice(),
        &[Wait {
            stream: S1,
            fence: Fence(4)
        }]
    );
}

#[test]
fn release_free_segments_in_id_order() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(64 * MIB, S0));
    let b = alloc(&mut c, AllocRequest::new(4096, S0));
    let d = alloc(&mut c, AllocRequest::new(32 * MIB, S0));
    free(&mut c, &a);
    free(&mut c, &d);
    let released = c.release_free_segments();
    assert_eq!(released, vec![(a.segment, 64 * MIB), (d.segment, 32 * MIB)]);
    c.check_invariants().unwrap();
    assert_eq!(c.stats().segments.current, 1);
    assert_eq!(c.stats().reserved_bytes.current, 2 * MIB);
    free(&mut c, &b);
    // A new segment gets a fresh id, never a released one.
    let e = alloc(&mut c, AllocRequest::new(64 * MIB, S0));
    assert_eq!(e.segment, SegmentId(3));
}

#[test]
fn peaks_and_reset() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(MIB, S0));
    free(&mut c, &a);
    let s = c.stats();
    assert_eq!(s.allocated_bytes.peak, MIB);
    assert_eq!(s.allocated_bytes.current, 0);
    c.reset_peak();
    assert_eq!(c.stats().allocated_bytes.peak, 0);
    assert_eq!(c.stats().reserved_bytes.peak, 2 * MIB);
}

#[test]
fn snapshot_round_trips_through_serde() {
    let mut c = core();
    let a = alloc(&mut c, AllocRequest::new(5000, S0));
    c.record_stream(a.block, S1).unwrap();
    let _b = alloc(&mut c, AllocRequest::new(30 * MIB, S1));
    let snap = c.snapshot();
    let json = serde_json::to_string(&snap).unwrap();
    let back: Snapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(back, snap);
    assert_eq!(snap.segments[0].blocks[0].other_streams, vec![S1]);
    assert_eq!(snap.segments[0].blocks[0].requested_bytes, 5000);
}

// Regressions found by the model-based test (tests/core_model.rs).

#[test]
fn small_segments_larger_than_large_segments_serve_small_requests() {
    // A valid config whose small segments (32 MiB) exceed the shared large segment
    // size (20 MiB): the dedicated-segment rule used to skip them, so the core asked
    // for another small segment after every growth, forever.
    let mut c = Allocator::new(CoreConfig::default().with_small(MIB, 32 * MIB)).unwrap();
    let req = AllocRequest::new(4096, S0);
    assert_eq!(
        c.alloc(req),
        Err(AllocError::NeedsGrowth(Growth {
            class: SizeClass::Small,
            segment_bytes: 32 * MIB
        }))
    );
    let p = alloc(&mut c, req);
    assert_eq!((p.segment, p.offset_bytes), (SegmentId(0), 0));
    assert_eq!(c.stats().num_growths, 1);
}

#[test]
fn reuse_ratio_one_is_refused() {
    // With ratio 1 a dedicated segment, rounded up past its request, could never
    // serve that request: growth would repeat forever.
    let mut cfg = CoreConfig::default();
    cfg.dedicated_reuse_ratio = 1;
    assert!(matches!(Allocator::new(cfg), Err(AllocError::Config(_))));
    for ratio in [0, 2, 4] {
        cfg.dedicated_reuse_ratio = ratio;
        let mut c = Allocator::new(cfg).unwrap();
        let p = alloc(&mut c, AllocRequest::new(30 * MIB + 1, S0));
        assert_eq!(c.stats().num_growths, 1, "ratio {ratio}");
        assert_eq!(p.offset_bytes, 0);
    }
}

#[test]
fn small_requests_do_not_use_the_tail_of_a_dedicated_segment() {
    // 250 MiB gets a 256 MiB dedicated segment, leaving a 6 MiB free tail. A 4 MiB
    // request is below 1/4 of the segment, so (as documented) it must not use the
    // tail, which would pin the segment; it gets a shared large segment instead.
    let mut c = core();
    let big = alloc(&mut c, AllocRequest::new(250 * MIB, S0));
    assert_eq!(
        c.segments().next(),
        Some((SegmentId(0), SizeClass::Large, 256 * MIB))
    );
    let small = alloc(&mut c, AllocRequest::new(4 * MIB, S0));
    assert_ne!(small.segment, big.segment);
    assert_eq!(
        c.segments().nth(1),
        Some((SegmentId(1), SizeClass::Large, 20 * MIB))
    );
    // A request of at least 1/4 of the segment may use it.
    free(&mut c, &big);
    let quarter = alloc(&mut c, AllocRequest::new(64 * MIB, S0));
    assert_eq!((quarter.segment, quarter.offset_bytes), (big.segment, 0));
    free(&mut c, &small);
    assert_eq!(c.release_free_segments(), vec![(SegmentId(1), 20 * MIB)]);
}

#[test]
fn sizes_beyond_16_tib_are_refused() {
    let mut c = core();
    assert!(matches!(
        c.add_segment(Growth {
            class: SizeClass::Large,
            segment_bytes: MAX_SEGMENT_BYTES + (2 << 20)
        }),
        Err(AllocError::BadSegmentSize { .. })
    ));
    assert!(matches!(
        c.add_shared_segment(MAX_SEGMENT_BYTES * 2),
        Err(AllocError::BadSegmentSize { .. })
    ));
    let cfg = CoreConfig::default().with_max_request_bytes(MAX_SEGMENT_BYTES + 1);
    assert!(matches!(Allocator::new(cfg), Err(AllocError::Config(_))));
    c.check_invariants().unwrap();
}

#[test]
fn a_16_tib_segment_is_indexed() {
    let mut c =
        Allocator::new(CoreConfig::default().with_max_request_bytes(MAX_SEGMENT_BYTES)).unwrap();
    let id = c.add_shared_segment(MAX_SEGMENT_BYTES).unwrap();
    c.check_invariants().unwrap();
    let p = c.alloc(AllocRequest::new(MAX_SEGMENT_BYTES, S0)).unwrap();
    assert_eq!(
        (p.segment, p.offset_bytes, p.size_bytes),
        (id, 0, MAX_SEGMENT_BYTES)
    );
    c.free(p.block, &[]).unwrap();
    c.check_invariants().unwrap();
}

// ---------------------------------------------------------------------------------
// The registered growth policy and fit-to-peak
// ---------------------------------------------------------------------------------

fn large(bytes: u64) -> Growth {
    Growth {
        class: SizeClass::Large,
        segment_bytes: bytes,
    }
}

#[test]
fn registered_policy_table() {
    let c = CoreConfig::registered();
    c.validate().unwrap();
    assert!(!CoreConfig::default().growth.is_registered());
    // Small requests: at least the 32 MiB small chunk, then half the small class's
    // live bytes, capped at 4 GiB.
    let small = |bytes| Growth {
        class: SizeClass::Small,
        segment_bytes: bytes,
    };
    assert_eq!(c.growth_with(MIB, 0), Ok(small(32 * MIB)));
    assert_eq!(c.growth_with(4096, 60 * MIB), Ok(small(32 * MIB)));
    assert_eq!(c.growth_with(4096, 100 * MIB), Ok(small(50 * MIB)));
    assert_eq!(c.growth_with(4096, 300 * MIB), Ok(small(150 * MIB)));
    assert_eq!(c.growth_with(MIB, 10 << 40), Ok(small(4 << 30)));
    // Large: the default chunk is half the large class's live bytes.
    assert_eq!(c.growth_with(2 * MIB, 448 * MIB), Ok(large(448 * MIB)));
    assert_eq!(c.growth_with(2 * MIB, 1200 * MIB), Ok(large(600 * MIB)));
    // The rest of the table at 100 % growth.
    let c = c.with_growth_percent(100);
    // Large: at least the 448 MiB minimum chunk…
    assert_eq!(c.growth_with(MIB + 512, 0), Ok(large(448 * MIB)));
    assert_eq!(c.growth_with(250 * MIB, 0), Ok(large(448 * MIB)));
    // …at least what the large class has allocated…
    assert_eq!(c.growth_with(2 * MIB, 448 * MIB), Ok(large(448 * MIB)));
    assert_eq!(c.growth_with(2 * MIB, 600 * MIB), Ok(large(600 * MIB)));
    assert_eq!(
        c.growth_with(2 * MIB, 601 * MIB - 512),
        Ok(large(602 * MIB))
    );
    // …capped at 4 GiB…
    assert_eq!(c.growth_with(2 * MIB, 64 << 30), Ok(large(4 << 30)));
    // …and a larger request gets a segment that fits it, rounded as a dedicated one.
    assert_eq!(c.growth_with(500 * MIB, 0), Ok(large(512 * MIB)));
    assert_eq!(c.growth_with(5 << 30, 64 << 30), Ok(large(5 << 30)));
    // Growth percent and chunk bounds.
    let h = c
        .with_growth_percent(50)
        .with_chunk_bytes(32 * MIB, 256 * MIB);
    assert_eq!(h.growth_with(2 * MIB, 200 * MIB), Ok(large(100 * MIB)));
    assert_eq!(h.growth_with(2 * MIB, 0), Ok(large(32 * MIB)));
    assert_eq!(h.growth_with(2 * MIB, 1 << 30), Ok(large(256 * MIB)));
    // The caching table is untouched, whatever the large class reserves.
    let d = CoreConfig::default();
    assert_eq!(d.growth_with(2 * MIB, 1 << 30), Ok(large(20 * MIB)));
    assert_eq!(d.growth_with(250 * MIB, 1 << 30), Ok(large(256 * MIB)));
}

#[test]
fn registered_policy_validation() {
    let bad = |c: CoreConfig| assert!(matches!(c.validate(), Err(AllocError::Config(_))));
    let c = CoreConfig::registered();
    bad(c.with_chunk_bytes(0, 64 * MIB));
    bad(c.with_chunk_bytes(MIB, 64 * MIB));
    bad(c.with_chunk_bytes(128 * MIB, 64 * MIB));
    bad(c.with_chunk_bytes(64 * MIB, 2 * MAX_SEGMENT_BYTES));
    bad(c.with_growth_percent(10_001));
    bad(c.with_fit_headroom_percent(101));
    c.with_growth_percent(0).validate().unwrap();
    // Serde round trip, and configs from before the field read as caching.
    let json = serde_json::to_string(&c).unwrap();
    assert_eq!(serde_json::from_str::<CoreConfig>(&json).unwrap(), c);
    let mut v: serde_json::Value = serde_json::to_value(CoreConfig::default()).unwrap();
    v.as_object_mut().unwrap().remove("growth");
    assert_eq!(
        serde_json::from_value::<CoreConfig>(v).unwrap(),
        CoreConfig::default()
    );
}

#[test]
fn registered_segments_are_shared_and_grow_with_the_live_bytes() {
    let cfg = CoreConfig::registered()
        .with_chunk_bytes(64 * MIB, 4096 * MIB)
        .with_growth_percent(100);
    let mut c = Allocator::new(cfg).unwrap();
    let a = alloc(&mut c, AllocRequest::new(2 * MIB, S0));
    assert_eq!(c.stats().large.reserved_bytes.current, 64 * MIB);
    // A small-large request shares the chunk (no dedicated-segment rule).
    let b = alloc(&mut c, AllocRequest::new(3 * MIB, S0));
    assert_eq!(b.segment, a.segment);
    // 5 MiB live: the chunk is the minimum; the 100 MiB request needs more.
    let big = alloc(&mut c, AllocRequest::new(100 * MIB, S0));
    assert_eq!(c.stats().large.reserved_bytes.current, (64 + 100) * MIB);
    // 105 MiB live, reserve 164 MiB: the chunk follows the live bytes, not the reserve.
    let more = alloc(&mut c, AllocRequest::new(100 * MIB, S0));
    assert_eq!(
        c.stats().large.reserved_bytes.current,
        (64 + 100 + 106) * MIB
    );
    // Every live block stayed where it was.
    for p in [&a, &b, &big] {
        assert_eq!(
            c.locate(p.block),
            Ok((p.segment, p.offset_bytes, p.size_bytes))
        );
    }
    let s = c.stats();
    assert_eq!(s.large.segments.current, 3);
    assert_eq!(s.small.segments.current, 0);
    assert_eq!(
        c.class_allocated_bytes(SizeClass::Large),
        s.allocated_bytes.current
    );
    assert_eq!(c.class_allocated_bytes(SizeClass::Small), 0);
    free(&mut c, &more);
}

#[test]
fn class_stats_add_up() {
    let mut c = core();
    let s1 = alloc(&mut c, AllocRequest::new(4096, S0));
    let l1 = alloc(&mut c, AllocRequest::new(3 * MIB, S0));
    let s = c.stats();
    assert_eq!(
        s.small.segments.current + s.large.segments.current,
        s.segments.current
    );
    assert_eq!(s.small.reserved_bytes.current, 2 * MIB);
    assert_eq!(s.large.reserved_bytes.current, 20 * MIB);
    assert_eq!(c.class_allocated_bytes(SizeClass::Small), 4096);
    assert_eq!(c.class_allocated_bytes(SizeClass::Large), 3 * MIB);
    free(&mut c, &l1);
    assert_eq!(c.class_allocated_bytes(SizeClass::Large), 0);
    free(&mut c, &s1);
    assert_eq!(c.class_allocated_bytes(SizeClass::Small), 0);
    c.reset_peak();
    assert_eq!(c.stats().large.reserved_bytes.peak, 20 * MIB);
    c.release_free_segments();
    let l = c.stats().large;
    assert_eq!((l.segments.current, l.reserved_bytes.current), (0, 0));
    assert_eq!(l.reserved_bytes.peak, 20 * MIB);
}

#[test]
fn fit_to_peak_replaces_free_segments_with_one_of_the_peak() {
    let cfg = CoreConfig::registered()
        .with_chunk_bytes(64 * MIB, 4096 * MIB)
        .with_fit_headroom_percent(0);
    let mut c = Allocator::new(cfg).unwrap();
    // A persistent block, allocated before the window.
    let keep = alloc(&mut c, AllocRequest::new(8 * MIB, S0));
    c.reset_peak();
    let mut step = Vec::new();
    for mib in [30, 60, 120, 10] {
        step.push(alloc(&mut c, AllocRequest::new(mib * MIB, S0)));
    }
    for p in &step {
        free(&mut c, p);
    }
    // 64 MiB (keep, 30, 10 MiB), 64 MiB (60), 120 MiB (120): the last two are free.
    let plan = c.plan_fit_to_peak();
    let peak = c.stats().allocated_bytes.peak;
    assert_eq!(peak, (8 + 220) * MIB);
    assert_eq!(plan.release.len(), 2);
    assert_eq!(plan.add, vec![large(220 * MIB)]);
    let (released, added) = c.apply_fit_plan(&plan).unwrap();
    assert_eq!(released, plan.release);
    assert_eq!(added.len(), 1);
    assert_eq!(c.locate(keep.block), Ok((keep.segment, 0, 8 * MIB)));
    c.check_invariants().unwrap();
    // The same step again: no growth.
    let growths = c.stats().num_growths;
    let mut again = Vec::new();
    for mib in [30, 60, 120, 10] {
        again.push(alloc(&mut c, AllocRequest::new(mib * MIB, S0)));
    }
    assert_eq!(c.stats().num_growths, growths);
    // A stale plan is refused and changes nothing.
    let before = c.snapshot();
    assert_eq!(
        c.release_planned(&plan),
        Err(AllocError::UnknownSegment(plan.release[0].0))
    );
    assert_eq!(c.snapshot(), before);
    for p in &again {
        free(&mut c, p);
    }
    // Nothing entirely free in a class: nothing planned for it.
    let busy = c.plan_fit_to_peak();
    assert!(busy.release.iter().all(|r| r.0 != keep.segment));
    let empty = Allocator::new(CoreConfig::registered()).unwrap();
    assert!(empty.plan_fit_to_peak().is_empty());
}
