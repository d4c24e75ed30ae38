//! cuBLAS (through cudarc) for the GPU parts of the example, tests and benchmarks:
//! bf16 GEMMs with fp32 accumulation, axpy, scal and a sum of squares on raw device pointers.
//! Column-major, as cuBLAS is.

#![allow(dead_code)]

use cudarc::cublas::{CudaBlas, sys};
use cudarc::driver::CudaStream;
use std::ffi::c_void;
use std::sync::Arc;

/// A cuBLAS handle bound to one stream.
pub struct Blas {
    blas: CudaBlas,
}

fn check(op: &str, s: sys::cublasStatus_t) -> Result<(), String> {
    if s == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("{op} failed: {s:?}"))
    }
}

const BF16: sys::cudaDataType = sys::cudaDataType::CUDA_R_16BF;
const F32: sys::cudaDataType = sys::cudaDataType::CUDA_R_32F;

impl Blas {
    /// A handle whose work goes to `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, String> {
        let blas = CudaBlas::new(stream).map_err(|e| format!("cublasCreate: {e:?}"))?;
        Ok(Blas { blas })
    }

    /// `C (m×n) = alpha · op(A) · op(B) + beta · C`, bf16 operands, fp32 accumulation.
    ///
    /// # Safety
    /// The pointers are live device memory of the handle's device, of the sizes the
    /// shapes and leading dimensions imply, until the stream passes this call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_bf16(
        &self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: u64,
        lda: usize,
        b: u64,
        ldb: usize,
        beta: f32,
        c: u64,
        ldc: usize,
    ) -> Result<(), String> {
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // SAFETY: the caller guarantees the pointers and sizes; alpha and beta are host
        // scalars read during the call (default host pointer mode).
        let s = unsafe {
            sys::cublasGemmEx(
                *self.blas.handle(),
                op(ta),
                op(tb),
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                BF16,
                lda as i32,
                b as *const c_void,
                BF16,
                ldb as i32,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                BF16,
                ldc as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        };
        check("cublasGemmEx", s)
    }

    /// `y += alpha · x` over `n` bf16 elements.
    ///
    /// # Safety
    /// `x` and `y` are live device memory of `n` bf16 elements.
    pub unsafe fn axpy_bf16(&self, n: usize, alpha: f32, x: u64, y: u64) -> Result<(), String> {
        // SAFETY: as the caller guarantees.
        let s = unsafe {
            sys::cublasAxpyEx_64(
                *self.blas.handle(),
                n as i64,
                &alpha as *const f32 as *const c_void,
                F32,
                x as *const c_void,
                BF16,
                1,
                y as *mut c_void,
                BF16,
                1,
                F32,
            )
        };
        check("cublasAxpyEx", s)
    }

    /// `x *= alpha` over `n` bf16 elements.
    ///
    /// # Safety
    /// `x` is live device memory of `n` bf16 elements.
    pub unsafe fn scal_bf16(&self, n: usize, alpha: f32, x: u64) -> Result<(), String> {
        // SAFETY: as the caller guarantees.
        let s = unsafe {
            sys::cublasScalEx_64(
                *self.blas.handle(),
                n as i64,
                &alpha as *const f32 as *const c_void,
                F32,
                x as *mut c_void,
                BF16,
                1,
                F32,
            )
        };
        check("cublasScalEx", s)
    }

    /// Sum of squares of `n` bf16 elements into the f32 at device address `out`, with
    /// fp32 accumulation, without waiting for the stream: a 1×1 GEMM `xᵀ·x`
    /// (`cublasNrm2Ex` has no bf16-in, fp32-out variant).
    ///
    /// # Safety
    /// `x` is live device memory of `n` bf16 elements; `out` a live device f32.
    pub unsafe fn sumsq_bf16(&self, n: usize, x: u64, out: u64) -> Result<(), String> {
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: as the caller guarantees; alpha and beta are host scalars read during
        // the call; C (one f32) is device memory written on the stream.
        let s = unsafe {
            sys::cublasGemmEx(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                1,
                1,
                n as i32,
                &alpha as *const f32 as *const c_void,
                x as *const c_void,
                BF16,
                n as i32,
                x as *const c_void,
                BF16,
                n as i32,
                &beta as *const f32 as *const c_void,
                out as *mut c_void,
                F32,
                1,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        };
        check("cublasGemmEx (sum of squares)", s)
    }
}
