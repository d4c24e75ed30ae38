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
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u8 {}
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

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

/// The half-precision types, which convert through their own `to_f64`/`from_f64`.
macro_rules! half_element {
    ($($t:ident => $dtype:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn to_f64(self) -> f64 {
                $t::to_f64(self)
            }
            fn from_f64(x: f64) -> Self {
                $t::from_f64(x)
            }
        }
    )*};
}

half_element!(f16 => F16, bf16 => BF16);

impl Element for u8 {
    const DTYPE: DType = DType::U8;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(x: f64) -> Self {
        (x as i64).rem_euclid(256) as u8
    }
}

/// Reduce element `i` of each rank's chunk, in place into `acc`, in the element type's
/// own arithmetic (as NCCL does: f16/bf16 round after each addition).
pub(crate) fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], other: &[u8]) {
    fn go<T: Element>(op: ReduceOp, acc: &mut [u8], other: &[u8]) {
        let n = acc.len() / std::mem::size_of::<T>();
        for i in 0..n {
            let r = i * std::mem::size_of::<T>()..(i + 1) * std::mem::size_of::<T>();
            let a: T = bytemuck::pod_read_unaligned(&acc[r.clone()]);
            let b: T = bytemuck::pod_read_unaligned(&other[r.clone()]);
            let (x, y) = (a.to_f64(), b.to_f64());
            let v = match op {
                ReduceOp::Sum | ReduceOp::Avg => x + y,
                ReduceOp::Prod => x * y,
                ReduceOp::Max => x.max(y),
                ReduceOp::Min => x.min(y),
            };
            acc[r].copy_from_slice(bytemuck::bytes_of(&T::from_f64(v)));
        }
    }
    match dtype {
        DType::F32 => go::<f32>(op, acc, other),
        DType::F16 => go::<f16>(op, acc, other),
        DType::BF16 => go::<bf16>(op, acc, other),
        DType::U8 => go::<u8>(op, acc, other),
    }
}

/// Divide every element by `n` (the last step of `Avg`).
pub(crate) fn divide(dtype: DType, acc: &mut [u8], n: usize) {
    fn go<T: Element>(acc: &mut [u8], n: usize) {
        for c in acc.chunks_exact_mut(std::mem::size_of::<T>()) {
            let a: T = bytemuck::pod_read_unaligned(c);
            c.copy_from_slice(bytemuck::bytes_of(&T::from_f64(a.to_f64() / n as f64)));
        }
    }
    match dtype {
        DType::F32 => go::<f32>(acc, n),
        DType::F16 => go::<f16>(acc, n),
        DType::BF16 => go::<bf16>(acc, n),
        DType::U8 => go::<u8>(acc, n),
    }
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
    let mut acc: Option<Vec<u8>> = None;
    for mut data in inputs {
        if premul {
            divide(dt, &mut data, n);
        }
        match &mut acc {
            None => acc = Some(data),
            Some(a) => reduce_into(dt, op, a, &data),
        }
    }
    let Some(mut acc) = acc else {
        return Err(crate::error::Error::Internal {
            what: "a collective with no ranks".into(),
        });
    };
    if op == ReduceOp::Avg && !premul {
        divide(dt, &mut acc, n);
    }
    Ok(acc)
}

#[cfg(test)]
#[path = "../tests/unit/dtype.rs"]
mod tests;
