//! cuBLAS (through cudarc) for the GPU parts of the example, tests and benchmarks:
//! bf16 GEMMs with fp32 accumulation, axpy, scal and a sum of squares, on typed views
//! of pool buffers (read through `CudaView`, made by `TypedView::cuda`, or any cudarc
//! slice; written through `CudaViewMut`, made by `SymmBuffer::cuda_mut`). Column-major, as cuBLAS
//! is; [`dense`] configures a GEMM of dense matrices (leading dimension = rows).
//!
//! The calls are safe: each checks its shapes against the views' lengths and the
//! views' device against the handle's, and a view borrows its buffer. What they cannot
//! check is the stream rule of every pool buffer: use a buffer on the stream it was
//! allocated on, or call `SymmBuffer::record_stream` for the handle's stream first, so
//! that the pool does not hand the block to another stream before this work is done.
//!
//! The GEMMs go through cudarc's `cublasGemmEx` binding rather than its `Gemm<bf16>`
//! trait: that trait takes alpha and beta as bf16 (0.05 would become 0.05005) and has
//! no bf16-in, f32-out form for the sum of squares. cudarc has no bf16 axpy or scal, so
//! those call `cublasAxpyEx` / `cublasScalEx`; `cublasSetSmCountTarget` lets a handle's
//! GEMMs leave SMs to other streams. Four `unsafe` blocks in all, one per cuBLAS
//! function, each after the checks that make it sound.

#![allow(dead_code)]

use cudarc::cublas::result::CublasError;
use cudarc::cublas::{CudaBlas, GemmConfig, result, sys};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use symmpool::{CudaViewMut, Error, Result, bf16};

/// A cuBLAS handle bound to one stream (default host pointer mode: alpha and beta are
/// host scalars).
pub struct Blas {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
}

/// The element types a GEMM may write: bf16 (the example's matrices) and f32 (the sum
/// of squares).
trait Output {
    /// Its cuBLAS data type.
    const TYPE: sys::cudaDataType;
}

impl Output for bf16 {
    const TYPE: sys::cudaDataType = sys::cudaDataType::CUDA_R_16BF;
}

impl Output for f32 {
    const TYPE: sys::cudaDataType = sys::cudaDataType::CUDA_R_32F;
}

/// The configuration of a dense GEMM `C (m×n) = alpha · op(A) · op(B) + beta · C`,
/// `op(X) = Xᵀ` when its flag is set; leading dimensions are the stored row counts.
///
/// # Errors
/// [`Error::BadView`] if a dimension does not fit cuBLAS's 32-bit `int`.
#[allow(clippy::too_many_arguments)]
pub fn dense(
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    beta: f32,
) -> Result<GemmConfig<f32>> {
    let int = |x: usize| {
        c_int::try_from(x).map_err(|_| Error::BadView(format!("GEMM dimension {x} over i32")))
    };
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    Ok(GemmConfig {
        transa: op(ta),
        transb: op(tb),
        m: int(m)?,
        n: int(n)?,
        k: int(k)?,
        alpha,
        lda: int(if ta { k } else { m })?,
        ldb: int(if tb { n } else { k })?,
        beta,
        ldc: int(m)?,
    })
}

/// Whether `len` elements hold a column-major `rows × cols` matrix of leading
/// dimension `ld`.
fn holds(len: usize, rows: c_int, cols: c_int, ld: c_int) -> bool {
    let (Ok(rows), Ok(cols), Ok(ld)) = (
        usize::try_from(rows),
        usize::try_from(cols),
        usize::try_from(ld),
    ) else {
        return false;
    };
    if ld < rows.max(1) {
        return false;
    }
    if rows == 0 || cols == 0 {
        return true;
    }
    ld.checked_mul(cols - 1)
        .and_then(|x| x.checked_add(rows))
        .is_some_and(|need| need <= len)
}

/// The `(rows, cols)` stored for an operand that is `rows_op × cols_op` after `op`.
fn stored(op: sys::cublasOperation_t, rows_op: c_int, cols_op: c_int) -> (c_int, c_int) {
    if op == sys::cublasOperation_t::CUBLAS_OP_N {
        (rows_op, cols_op)
    } else {
        (cols_op, rows_op)
    }
}

fn shape_error(what: &str, cfg: &GemmConfig<f32>) -> Error {
    Error::BadView(format!(
        "{what} is too short for the GEMM m={} n={} k={} (lda={} ldb={} ldc={})",
        cfg.m, cfg.n, cfg.k, cfg.lda, cfg.ldb, cfg.ldc
    ))
}

fn cublas(op: &'static str) -> impl FnOnce(CublasError) -> Error {
    move |e| Error::Cuda {
        op,
        code: e.0 as i32,
        message: format!("cuBLAS {e:?}"),
    }
}

impl Blas {
    /// A handle whose work goes to `stream`.
    ///
    /// # Errors
    /// [`Error::Cuda`] if `cublasCreate` fails.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let blas = CudaBlas::new(stream.clone()).map_err(cublas("cublasCreate"))?;
        Ok(Blas { blas, stream })
    }

    /// Let the handle's later calls plan for `sms` multiprocessors (0: all of them),
    /// `cublasSetSmCountTarget`, so that work on other streams finds SMs free.
    ///
    /// # Errors
    /// [`Error::BadView`] if `sms` does not fit a C `int`; [`Error::Cuda`] if cuBLAS
    /// refuses.
    pub fn set_sm_count_target(&self, sms: usize) -> Result<()> {
        let sms = c_int::try_from(sms).map_err(|_| Error::BadView(format!("{sms} SMs")))?;
        // SAFETY: the handle is live (owned by `self.blas`). The call sets one integer
        // of the handle, which every later call on the handle reads; cuBLAS handles
        // are not to be used from two threads at once, and every `Blas` of the
        // example and tests lives in a single-threaded owner (the example's `GpuMath`
        // holds `Rc`s, so it is not `Send`), so no call on this handle runs meanwhile.
        unsafe { sys::cublasSetSmCountTarget(*self.blas.handle(), sms) }
            .result()
            .map_err(cublas("cublasSetSmCountTarget"))
    }

    /// [`Error::WrongStream`] unless `view` is memory of the handle's device (context).
    fn same_device<T>(&self, view: &impl DeviceSlice<T>) -> Result<()> {
        if view.stream().context() == self.stream.context() {
            Ok(())
        } else {
            Err(Error::WrongStream)
        }
    }

    /// `C = alpha · op(A) · op(B) + beta · C` as `cfg` says, bf16 matrices, fp32
    /// accumulation, enqueued on the handle's stream (see the module's stream rule).
    ///
    /// # Errors
    /// [`Error::BadView`] if a view is shorter than its matrix; [`Error::WrongStream`]
    /// for a view of another device; [`Error::Cuda`] if cuBLAS fails.
    pub fn gemm_bf16(
        &self,
        cfg: &GemmConfig<f32>,
        a: &impl DevicePtr<bf16>,
        b: &impl DevicePtr<bf16>,
        c: &mut CudaViewMut<'_, bf16>,
    ) -> Result<()> {
        self.gemm_ex(cfg, a, b, c, "cublasGemmEx")
    }

    /// The sum of squares of `x`, with fp32 accumulation, into `out[0]`, without
    /// waiting for the stream: a 1×1 GEMM `xᵀ·x` (`cublasNrm2Ex` has no bf16-in,
    /// fp32-out form).
    ///
    /// # Errors
    /// [`Error::BadView`] if `out` is empty or `x` longer than an `int`;
    /// [`Error::WrongStream`] for a view of another device; [`Error::Cuda`] if cuBLAS
    /// fails.
    pub fn sumsq_bf16(
        &self,
        x: &impl DevicePtr<bf16>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let cfg = dense(true, false, 1, 1, x.len(), 1.0, 0.0)?;
        self.gemm_ex(&cfg, x, x, out, "cublasGemmEx (sum of squares)")
    }

    /// The one GEMM: bf16 A and B, C of type `C`, fp32 compute, after checking every
    /// operand against `cfg`.
    fn gemm_ex<C: Output>(
        &self,
        cfg: &GemmConfig<f32>,
        a: &impl DevicePtr<bf16>,
        b: &impl DevicePtr<bf16>,
        c: &mut CudaViewMut<'_, C>,
        op: &'static str,
    ) -> Result<()> {
        let (a_rows, a_cols) = stored(cfg.transa, cfg.m, cfg.k);
        let (b_rows, b_cols) = stored(cfg.transb, cfg.k, cfg.n);
        if !holds(a.len(), a_rows, a_cols, cfg.lda) {
            return Err(shape_error("A", cfg));
        }
        if !holds(b.len(), b_rows, b_cols, cfg.ldb) {
            return Err(shape_error("B", cfg));
        }
        if !holds(c.len(), cfg.m, cfg.n, cfg.ldc) {
            return Err(shape_error("C", cfg));
        }
        self.same_device(a)?;
        self.same_device(b)?;
        self.same_device(c)?;
        let (a_ptr, _a) = a.device_ptr(&self.stream);
        let (b_ptr, _b) = b.device_ptr(&self.stream);
        let (c_ptr, _c) = c.device_ptr_mut(&self.stream);
        // SAFETY: A, B and C are memory of the handle's device (checked above), each
        // long enough for its matrix as `cfg`'s shapes and leading dimensions read it
        // (checked above), and alive while this call enqueues: the views borrow their
        // pool buffers, whose blocks the pool keeps from reuse and release until the
        // streams they are used on pass. alpha and beta are host f32 scalars (the
        // handle's default pointer mode) that cuBLAS reads before returning.
        unsafe {
            result::gemm_ex(
                *self.blas.handle(),
                cfg.transa,
                cfg.transb,
                cfg.m,
                cfg.n,
                cfg.k,
                (&cfg.alpha as *const f32).cast::<c_void>(),
                a_ptr as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                cfg.lda,
                b_ptr as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                cfg.ldb,
                (&cfg.beta as *const f32).cast::<c_void>(),
                c_ptr as *mut c_void,
                C::TYPE,
                cfg.ldc,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(cublas(op))
    }

    /// `y[..n] += alpha · x` over the `n = x.len()` elements of `x`, fp32 compute.
    ///
    /// # Errors
    /// [`Error::BadView`] if `y` is shorter than `x`; [`Error::WrongStream`] for a view
    /// of another device; [`Error::Cuda`] if cuBLAS fails.
    pub fn axpy_bf16(
        &self,
        alpha: f32,
        x: &impl DevicePtr<bf16>,
        y: &mut CudaViewMut<'_, bf16>,
    ) -> Result<()> {
        if y.len() < x.len() {
            return Err(Error::BadView(format!(
                "axpy of {} elements into {}",
                x.len(),
                y.len()
            )));
        }
        self.same_device(x)?;
        self.same_device(y)?;
        let n = element_count(x.len())?;
        let (x_ptr, _x) = x.device_ptr(&self.stream);
        let (y_ptr, _y) = y.device_ptr_mut(&self.stream);
        // SAFETY: x and y are memory of the handle's device holding at least n bf16
        // elements each (checked above), alive while the call enqueues (see
        // `gemm_ex`); alpha is a host f32 read before the call returns.
        unsafe {
            sys::cublasAxpyEx_64(
                *self.blas.handle(),
                n,
                (&alpha as *const f32).cast::<c_void>(),
                sys::cudaDataType::CUDA_R_32F,
                x_ptr as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                1,
                y_ptr as *mut c_void,
                sys::cudaDataType::CUDA_R_16BF,
                1,
                sys::cudaDataType::CUDA_R_32F,
            )
        }
        .result()
        .map_err(cublas("cublasAxpyEx"))
    }

    /// `x *= alpha` over all of `x`, fp32 compute.
    ///
    /// # Errors
    /// [`Error::WrongStream`] for a view of another device; [`Error::Cuda`] if cuBLAS
    /// fails.
    pub fn scal_bf16(&self, alpha: f32, x: &mut CudaViewMut<'_, bf16>) -> Result<()> {
        self.same_device(x)?;
        let n = element_count(x.len())?;
        let (x_ptr, _x) = x.device_ptr_mut(&self.stream);
        // SAFETY: x is memory of the handle's device holding n bf16 elements (its
        // length), alive while the call enqueues (see `gemm_ex`); alpha is a host f32
        // read before the call returns.
        unsafe {
            sys::cublasScalEx_64(
                *self.blas.handle(),
                n,
                (&alpha as *const f32).cast::<c_void>(),
                sys::cudaDataType::CUDA_R_32F,
                x_ptr as *mut c_void,
                sys::cudaDataType::CUDA_R_16BF,
                1,
                sys::cudaDataType::CUDA_R_32F,
            )
        }
        .result()
        .map_err(cublas("cublasScalEx"))
    }
}

/// An element count as cuBLAS's 64-bit count.
fn element_count(len: usize) -> Result<i64> {
    i64::try_from(len).map_err(|_| Error::BadView(format!("{len} elements over i64")))
}
