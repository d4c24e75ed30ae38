use super::super::{AllocError, AllocRequest, Allocator, CoreConfig, SegmentId, StreamId};

#[test]
fn invariant_checker_detects_corruption() {
    let mut c = Allocator::new(CoreConfig::default()).unwrap();
    let req = AllocRequest::new(4096, StreamId(0));
    if let Err(AllocError::NeedsGrowth(g)) = c.alloc(req) {
        c.add_segment(g).unwrap();
    }
    let _a = c.alloc(req).unwrap();
    c.check_invariants().unwrap();
    let mut broken = c.clone();
    broken.stats.allocated_bytes.current += 512;
    assert!(broken.check_invariants().is_err());
    let mut broken = c.clone();
    let key = broken.free[0].iter().next().unwrap();
    broken.free[0].remove(&key);
    assert!(broken.check_invariants().is_err());
    let mut broken = c.clone();
    let slot = broken.segments[&SegmentId(0)].first;
    broken.blocks[slot as usize].size -= 512;
    assert!(broken.check_invariants().is_err());
}
