//! Host-side cost of one collective call through the crate (checks, path choice,
//! dispatch), measured against a backend whose collectives do nothing, beside a
//! direct call of that backend: the difference is what the crate adds per call.

#![allow(missing_docs)] // criterion_group! expands to an undocumented `pub fn`.
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::sync::Arc;
use symmpool::backend::{
    Backend, BackendKind, CollArgs, CommInfo, Region, Registration, SegmentKey,
};
use symmpool::core::{Fence, SegmentId, StreamId};
use symmpool::{Exchange, LocalExchange, NcclVersion, PoolConfig, Result, Stream, SymmPool, coll};

/// Two "ranks" worth of bookkeeping and no work at all.
#[derive(Debug)]
struct NullBackend {
    comms: Vec<CommInfo>,
    exchange: LocalExchange,
}

impl Backend for NullBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn nccl_version(&self) -> NcclVersion {
        NcclVersion::new(2, 28, 3)
    }
    fn granularity_bytes(&self) -> u64 {
        2 << 20
    }
    fn communicators(&self) -> &[CommInfo] {
        &self.comms
    }
    fn exchange(&self) -> &dyn Exchange {
        &self.exchange
    }
    fn alloc_segment(&self, _: SegmentKey, _: u64) -> Result<()> {
        Ok(())
    }
    fn free_segment(&self, _: SegmentKey) -> Result<()> {
        Ok(())
    }
    fn register(&self, _: SegmentKey, _: usize) -> Result<Registration> {
        Ok(Registration::Symmetric)
    }
    fn deregister(&self, _: SegmentKey, _: usize) -> Result<()> {
        Ok(())
    }
    fn new_stream(&self) -> Result<Stream> {
        Ok(Stream::host())
    }
    fn record_fence(&self, _: &Stream) -> Result<Fence> {
        Ok(Fence(1))
    }
    fn wait_fence(&self, _: &Stream, _: StreamId, _: Fence) -> Result<()> {
        Ok(())
    }
    fn is_capturing(&self, _: &Stream) -> Result<bool> {
        Ok(false)
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn write(&self, _: Region, _: &[u8], _: &Stream) -> Result<()> {
        Ok(())
    }
    fn read(&self, _: Region, _: &mut [u8], _: &Stream) -> Result<()> {
        Ok(())
    }
    fn device_ptr(&self, _: Region) -> Option<u64> {
        None
    }
    fn time_ms(&self, _: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        f().map(|()| 0.0)
    }
    fn all_gather(&self, a: &CollArgs<'_>) -> Result<()> {
        black_box(a);
        Ok(())
    }
    fn reduce_scatter(&self, a: &CollArgs<'_>) -> Result<()> {
        black_box(a);
        Ok(())
    }
}

fn bench(c: &mut Criterion) {
    let backend = Arc::new(NullBackend {
        comms: CommInfo::STANDARD.to_vec(),
        exchange: LocalExchange::group(1).pop().expect("one rank"),
    });
    let pool = SymmPool::new(backend.clone(), PoolConfig::default()).expect("pool");
    let stream = Stream::host();
    let buf = pool.alloc(2 << 20, &stream).expect("buffer");
    let out = pool.alloc(1 << 20, &stream).expect("buffer");
    let mut g = c.benchmark_group("collective_call");
    g.bench_function("backend_direct", |b| {
        let args = CollArgs {
            comm: 0,
            send: Region {
                segment: SegmentKey::new(1, SegmentId(0)),
                offset_bytes: 0,
                len_bytes: 1 << 20,
                device_ptr: None,
            },
            recv: Region {
                segment: SegmentKey::new(1, SegmentId(0)),
                offset_bytes: 0,
                len_bytes: 2 << 20,
                device_ptr: None,
            },
            count: 1 << 20,
            dtype: symmpool::DType::U8,
            op: symmpool::ReduceOp::Sum,
            stream: &stream,
            symmetric: true,
        };
        b.iter(|| backend.all_gather(black_box(&args)))
    });
    g.bench_function("all_gather_in_place", |b| {
        b.iter(|| coll::all_gather_in_place::<u8>(black_box(&buf), &stream).expect("call"))
    });
    g.bench_function("reduce_scatter", |b| {
        b.iter(|| {
            coll::reduce_scatter::<symmpool::bf16>(
                black_box(&buf),
                &out,
                symmpool::ReduceOp::Sum,
                &stream,
            )
            .expect("call")
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
