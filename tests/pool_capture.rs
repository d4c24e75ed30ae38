//! `reserve`, `reserve_small` and `fit_to_peak` refuse to register while any stream
//! the pool has served is capturing a CUDA graph (on every rank), and `reserve_small`
//! pre-grows the small-block segments so that small allocations during capture hit the
//! cache.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use symmpool::{Error, GroupConfig, PoolConfig, Result, Stream, SymmPool};

mod common;

use common::capture::{EVERY_STREAM, capturing_groups};

/// Two host ranks whose streams report capture as the cell says.
fn capturing_world() -> (Arc<AtomicU64>, Vec<SymmPool>) {
    let (capturing, groups) = capturing_groups(2, &GroupConfig::default());
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    (capturing, pools)
}

/// `f` on every rank, a thread each; the results in rank order.
fn on_ranks(pools: &[SymmPool], f: &(dyn Fn(&SymmPool) -> Result<()> + Sync)) -> Vec<Result<()>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = pools.iter().map(|p| s.spawn(move || f(p))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn reserve_refuses_during_capture_and_reserve_small_serves_small_requests() {
    let (capturing, pools) = capturing_world();
    let run = |f: &(dyn Fn(&SymmPool) -> Result<()> + Sync)| on_ranks(&pools, f);
    // Before capture: the pool serves a stream, then pre-grows for small requests.
    let out = run(&|p| {
        drop(p.alloc(4 << 20, &Stream::host())?);
        p.reserve_small(2 << 20).map(drop)
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    capturing.store(EVERY_STREAM, Ordering::SeqCst);
    // During capture: reserving is refused on every rank, naming reserve_small.
    for r in run(&|p| p.reserve(4 << 20).map(drop)) {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::GraphCapture), "{e:?}");
        assert!(e.to_string().contains("reserve_small"), "{e}");
    }
    // Small requests hit the reserved small segment: no growth, no registration.
    let out = run(&|p| {
        let reserved = || p.memory_stats()["reserved_bytes.all.current"];
        let before = reserved();
        let bufs: Vec<_> = (0..8)
            .map(|_| p.alloc(64 << 10, &Stream::host()))
            .collect::<Result<_>>()?;
        assert_eq!(reserved(), before);
        drop(bufs);
        Ok(())
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

#[test]
fn fit_to_peak_refuses_during_capture_on_every_rank() {
    let (capturing, pools) = capturing_world();
    let run = |f: &(dyn Fn(&SymmPool) -> Result<()> + Sync)| on_ranks(&pools, f);
    // A warm-up step: its buffers grow the pool, and are freed.
    let step = |p: &SymmPool| -> Result<()> {
        let stream = Stream::host();
        let bufs = [
            p.alloc(4 << 20, &stream)?,
            p.alloc(3 << 20, &stream)?,
            p.alloc(64 << 10, &stream)?,
        ];
        drop(bufs);
        Ok(())
    };
    let out = run(&step);
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    // What a refused call must leave as it was.
    let kept = |p: &SymmPool| {
        let mut m = p.memory_stats();
        m.retain(|k, _| {
            ["segment.all.current", "reserved_bytes.all.current"].contains(&k.as_str())
                || k.starts_with("registrations.")
                || k.starts_with("deregistrations.")
        });
        m
    };
    let before: Vec<_> = pools.iter().map(kept).collect();
    capturing.store(EVERY_STREAM, Ordering::SeqCst);
    // During capture: refused on every rank, before anything is released or added.
    for r in run(&|p| p.fit_to_peak().map(drop)) {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::GraphCapture), "{e:?}");
    }
    for (p, b) in pools.iter().zip(&before) {
        assert_eq!(&kept(p), b);
    }
    // After capture the ranks are still in step: the same call fits the pool.
    capturing.store(0, Ordering::SeqCst);
    let out = run(&|p| p.fit_to_peak().map(drop));
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    let out = run(&step);
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}
