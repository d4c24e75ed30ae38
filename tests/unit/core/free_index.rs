use super::*;

#[test]
fn bins_grow_with_sizes_and_cover_u64() {
    let mut sizes: Vec<u64> = (0..64)
        .flat_map(|l| {
            let p = 1u64 << l;
            [p - 1, p, p + 1, p + p / 3, p.saturating_mul(2) - 1]
        })
        .collect();
    sizes.push(u64::MAX);
    sizes.sort_unstable();
    let bins: Vec<usize> = sizes.iter().map(|&s| bin_of(s)).collect();
    assert!(bins.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(bin_of(u64::MAX), BINS - 1);
    assert_eq!(bin_of(1), 1);
    assert_eq!(bin_of(31), 31);
    let width = 512 >> SUB_BITS;
    assert_eq!(bin_of(512), bin_of(512 + width - 1));
    assert_ne!(bin_of(512), bin_of(512 + width));
}

fn check_against(idx: &FreeIndex, all: &BTreeSet<FreeKey>) {
    use super::super::types::SegmentId;
    assert_eq!(idx.to_set().unwrap(), *all);
    assert!(idx.iter().eq(all.iter().copied()));
    for size in (1..=512 * 4200).step_by(512 * 37 - 100) {
        let start = (size, SegmentId(0), 0, 0);
        for modulus in [1, 2, 5, 1000] {
            let fit = |k: &FreeKey| k.3.is_multiple_of(modulus).then_some(k.2);
            let expect = all.range(start..).find_map(|k| fit(k).map(|t| (*k, t)));
            assert_eq!(idx.find_first(start, fit), expect);
        }
    }
}

#[test]
fn find_first_is_the_ordered_scan() {
    use super::super::types::SegmentId;
    let mut idx = FreeIndex::default();
    let mut all = BTreeSet::new();
    let mut x = 0x1234_5678_u64;
    for i in 0..4000u32 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Half spread over many bins, half crowding two bins (which become trees).
        let size = if i % 2 == 0 {
            512 * (1 + (x >> 33) % 4096)
        } else {
            512 * (8 + (x >> 33) % 2)
        };
        let key = (size, SegmentId(i % 7), u64::from(i) * 512, i);
        idx.insert(key);
        all.insert(key);
    }
    assert!(idx.bins.iter().any(|b| b.len() > 1000));
    check_against(&idx, &all);
    assert_eq!(idx.total_bytes(), all.iter().map(|k| k.0).sum::<u64>());
    // Remove most keys.
    let keys: Vec<FreeKey> = all.iter().copied().collect();
    for (i, key) in keys.into_iter().enumerate() {
        if i % 50 != 0 {
            assert!(idx.remove(&key));
            assert!(!idx.remove(&key));
            all.remove(&key);
        }
    }
    check_against(&idx, &all);
    assert_eq!(idx.total_bytes(), all.iter().map(|k| k.0).sum::<u64>());
}

#[test]
fn to_set_sees_a_broken_bitmap() {
    use super::super::types::SegmentId;
    let mut idx = FreeIndex::default();
    let key = (4096, SegmentId(0), 0, 0);
    idx.insert(key);
    assert_eq!(idx.to_set().unwrap().len(), 1);
    let b = bin_of(4096);
    let mut broken = idx.clone();
    broken.nonempty[b / 64] &= !(1 << (b % 64));
    assert!(broken.to_set().unwrap().is_empty(), "unmarked bin left out");
    let mut broken = idx.clone();
    broken.nonempty[0] |= 1;
    assert!(broken.to_set().is_err(), "marked empty bin");
    let mut broken = idx;
    broken.bins[b].remove(&pack(&key));
    broken.bins.resize_with(b + 2, BTreeMap::new);
    broken.bins[b + 1].insert(pack(&key), key.3);
    broken.nonempty[(b + 1) / 64] |= 1 << ((b + 1) % 64);
    assert!(broken.to_set().is_err(), "key in the wrong bin");
}
