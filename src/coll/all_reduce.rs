//! All-reduce: every rank's buffer becomes the reduction over ranks of every rank's
//! input, on NCCL's symmetric kernel when both buffers are in windows (and the policy
//! says so for the size) and on its ordinary kernels otherwise.

use super::call::NO_TAG;
use super::call::{elements, invalid, prepare};
use super::path::{AVG, CollOp};
use super::{Coll, CollectiveReport, TaggedColl};
use crate::dtype::{Element, ReduceOp};
use crate::error::Result;
use crate::pool::{SymmBuffer, SymmPool};
use crate::stream::Stream;

/// Refuse a reduction the backend's NCCL does not have (`ncclAvg` before 2.10).
fn check_op(op_name: &'static str, pool: &SymmPool, op: ReduceOp) -> Result<()> {
    let version = pool.backend().nccl_version();
    if op == ReduceOp::Avg && version < AVG {
        return Err(invalid(
            op_name,
            format!("ReduceOp::Avg needs NCCL {AVG} or later (ncclAvg); this is NCCL {version}"),
        ));
    }
    Ok(())
}

impl Coll {
    /// Out-of-place all-reduce: every rank's `output` (N elements of `T`) gets the
    /// reduction `op` over ranks of every rank's `input` (N elements of `T`), in the
    /// element type's arithmetic. `Sum` (and `Avg` from NCCL 2.30) on `f32`, `f16`
    /// and `bf16` may run NCCL's symmetric kernel; everything else runs NCCL's
    /// ordinary kernels (`ncclAllReduce` either way).
    ///
    /// # Collective
    /// Every rank, same order, same sizes and operation.
    ///
    /// # Errors
    /// [`Error::ForeignBuffer`](crate::Error::ForeignBuffer) if the buffers come from
    /// different pools (or another handle's pool); [`Error::PoolClosed`](crate::Error::PoolClosed);
    /// [`Error::InvalidCollective`](crate::Error::InvalidCollective) if `T` does not
    /// divide `input`, the buffers' sizes differ, or the reduction is `Avg` under an
    /// NCCL older than 2.10; backend errors (on the host backends also
    /// [`Error::Timeout`](crate::Error::Timeout));
    /// [`Error::CollectiveDivergence`](crate::Error::CollectiveDivergence) when the
    /// pool's collective check finds the ranks disagree (see the module
    /// documentation).
    #[inline]
    pub fn all_reduce<T: Element>(
        &self,
        input: &SymmBuffer,
        output: &SymmBuffer,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        self.tagged(NO_TAG)
            .all_reduce::<T>(input, output, op, stream)
    }

    /// In-place all-reduce: `buffer` (N elements of `T`) becomes the reduction `op`
    /// over ranks of every rank's `buffer`.
    ///
    /// # Collective
    /// Every rank, same order, same sizes and operation.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    #[inline]
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buffer: &SymmBuffer,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        self.tagged(NO_TAG)
            .all_reduce_in_place::<T>(buffer, op, stream)
    }
}

impl TaggedColl<'_> {
    /// As [`Coll::all_reduce`], carrying this handle's tag.
    ///
    /// # Collective
    /// As [`Coll::all_reduce`]; every rank passes the same tag.
    ///
    /// # Errors
    /// As [`Coll::all_reduce`]; [`Error::CollectiveDivergence`](crate::Error::CollectiveDivergence)
    /// naming the field `tag` when the ranks' tags differ (under `Strict` and `Async`).
    pub fn all_reduce<T: Element>(
        &self,
        input: &SymmBuffer,
        output: &SymmBuffer,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        const OP: &str = "all_reduce";
        let pool = prepare(&[input, output], stream)?;
        check_op(OP, pool, op)?;
        let count = elements::<T>(OP, "input", input.len_bytes())?;
        if input.len_bytes() != output.len_bytes() {
            return Err(invalid(
                OP,
                format!(
                    "output has {} bytes, expected {} (the input's)",
                    output.len_bytes(),
                    input.len_bytes()
                ),
            ));
        }
        self.coll.dispatch(
            pool,
            CollOp::AllReduce(op),
            (input, input.region()?),
            (output, output.region()?),
            count,
            T::DTYPE,
            stream,
            None,
            self.tag,
        )
    }

    /// As [`Coll::all_reduce_in_place`], carrying this handle's tag.
    ///
    /// # Collective
    /// As [`Coll::all_reduce_in_place`]; every rank passes the same tag.
    ///
    /// # Errors
    /// As [`Coll::all_reduce_in_place`]; [`Error::CollectiveDivergence`](crate::Error::CollectiveDivergence)
    /// naming the field `tag` when the ranks' tags differ (under `Strict` and `Async`).
    pub fn all_reduce_in_place<T: Element>(
        &self,
        buffer: &SymmBuffer,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<CollectiveReport> {
        const OP: &str = "all_reduce_in_place";
        let pool = prepare(&[buffer], stream)?;
        check_op(OP, pool, op)?;
        let count = elements::<T>(OP, "buffer", buffer.len_bytes())?;
        let whole = buffer.region()?;
        self.coll.dispatch(
            pool,
            CollOp::AllReduce(op),
            (buffer, whole),
            (buffer, whole),
            count,
            T::DTYPE,
            stream,
            None,
            self.tag,
        )
    }
}
