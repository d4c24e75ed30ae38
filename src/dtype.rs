//! Element types and reduction operations of the collectives.

use half::{bf16, f16};
use serde::Serialize;

/// Element type of a collective, named as NCCL names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum DType {
    /// `ncclFloat32`.
    F32,
    /// `ncclFloat16`.
    F16,
    /// `ncclBfloat16`.
    BF16,
    /// `ncclUint8`.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether NCCL's symmetric reduce-scatter kernels support this type
    /// (fp32/fp16/bf16/fp8; NCCL `ncclSymkImplemented`).
    pub const fn symmetric_reduce(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

/// Reduction operation of a reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ReduceOp {
    /// Sum (the only one NCCL's symmetric kernels run before 2.30).
    Sum,
    /// Product.
    Prod,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Average (sum divided by the number of ranks).
    Avg,
}

mod sealed {
    pub trait Sealed {}
}

/// An element type the collectives and typed views accept: `f32`, [`struct@f16`], [`bf16`]
/// and `u8`. Sealed.
pub trait Element:
    sealed::Sealed + bytemuck::Pod + Copy + Send + Sync + PartialEq + std::fmt::Debug + 'static
{
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Convert to `f64` (for host reductions and checks).
    fn to_f64(self) -> f64;
    /// Convert from `f64`, rounding to nearest (and wrapping modulo 256 for `u8`, as
    /// NCCL's `ncclUint8` sum does).
    fn from_f64(x: f64) -> Self;
}

/// [`Element`] for each type: its [`DType`] and its conversions to and from `f64`.
macro_rules! element {
    ($($t:ty => $dtype:ident, $to:expr, $from:expr;)*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
            fn from_f64(x: f64) -> Self {
                ($from)(x)
            }
        }
    )*};
}

element! {
    f32 => F32, f64::from, |x: f64| x as f32;
    f16 => F16, f16::to_f64, f16::from_f64;
    bf16 => BF16, bf16::to_f64, bf16::from_f64;
    u8 => U8, f64::from, |x: f64| (x as i64).rem_euclid(256) as u8;
}

/// Replace each element `a` of `acc` by `f(a, b)`, `b` the element of `other` at the
/// same place (`a` itself without `other`), in the element type's own arithmetic (as
/// NCCL does: f16/bf16 round after each operation).
fn combine(dtype: DType, acc: &mut [u8], other: Option<&[u8]>, f: impl Fn(f64, f64) -> f64) {
    fn go<T: Element>(acc: &mut [u8], other: Option<&[u8]>, f: impl Fn(f64, f64) -> f64) {
        let n = size_of::<T>();
        for (i, c) in acc.chunks_exact_mut(n).enumerate() {
            let a = bytemuck::pod_read_unaligned::<T>(c).to_f64();
            let b = other.map_or(a, |o| {
                bytemuck::pod_read_unaligned::<T>(&o[i * n..(i + 1) * n]).to_f64()
            });
            c.copy_from_slice(bytemuck::bytes_of(&T::from_f64(f(a, b))));
        }
    }
    match dtype {
        DType::F32 => go::<f32>(acc, other, f),
        DType::F16 => go::<f16>(acc, other, f),
        DType::BF16 => go::<bf16>(acc, other, f),
        DType::U8 => go::<u8>(acc, other, f),
    }
}

/// Reduce `other` into `acc` element by element (see [`combine`]).
pub(crate) fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], other: &[u8]) {
    combine(dtype, acc, Some(other), |x, y| match op {
        ReduceOp::Sum | ReduceOp::Avg => x + y,
        ReduceOp::Prod => x * y,
        ReduceOp::Max => x.max(y),
        ReduceOp::Min => x.min(y),
    })
}

/// Divide every element by `n` (the last step of `Avg`).
pub(crate) fn divide(dtype: DType, acc: &mut [u8], n: usize) {
    combine(dtype, acc, None, |x, _| x / n as f64)
}

/// The reduction over ranks, in rank order, with NCCL's averages: floating-point
/// averages scale each input by 1/ranks first and then sum (NCCL's pre-multiplied
/// sum), so they do not overflow where the mean fits; integer averages sum and then
/// divide, as NCCL does.
pub(crate) fn reduce_ranks(
    dt: DType,
    op: ReduceOp,
    inputs: Vec<Vec<u8>>,
) -> crate::error::Result<Vec<u8>> {
    let n = inputs.len();
    let premul = op == ReduceOp::Avg && dt != DType::U8;
    let mut inputs = inputs.into_iter().map(|mut data| {
        if premul {
            divide(dt, &mut data, n);
        }
        data
    });
    let Some(mut acc) = inputs.next() else {
        return Err(crate::error::Error::internal("a collective with no ranks"));
    };
    for data in inputs {
        reduce_into(dt, op, &mut acc, &data);
    }
    if op == ReduceOp::Avg && !premul {
        divide(dt, &mut acc, n);
    }
    Ok(acc)
}

#[cfg(test)]
#[path = "../tests/unit/dtype.rs"]
mod tests;
