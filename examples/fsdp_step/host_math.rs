//! [`Math`] on the host backend: f32 buffers, synchronous, naive loops (small sizes
//! only). The three streams exist because the pool and the collectives ask for one;
//! the timeline's markers are host clock reads (the work is done when the call returns).

use super::trainer::{Math, On};
use symmpool::{Result, Stream, SymmBuffer};

/// Host math: f32 buffers, synchronous, naive loops (small sizes only).
#[derive(Debug)]
pub struct HostMath {
    streams: [Stream; 3],
}

impl Default for HostMath {
    fn default() -> Self {
        HostMath {
            streams: [Stream::host(), Stream::host(), Stream::host()],
        }
    }
}

impl HostMath {
    fn get(x: &SymmBuffer) -> Result<Vec<f32>> {
        x.read::<f32>()
    }
}

impl Math for HostMath {
    type E = f32;
    fn stream(&self, on: On) -> &Stream {
        &self.streams[On::ALL.iter().position(|&o| o == on).unwrap_or(0)]
    }
    fn gemm(
        &self,
        _: On,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &SymmBuffer,
        b: &SymmBuffer,
        beta: f32,
        c: &mut SymmBuffer,
    ) -> Result<()> {
        let (av, bv, mut cv) = (Self::get(a)?, Self::get(b)?, Self::get(c)?);
        // op(A)[i][p]: A is m×k (lda m) or, transposed, k×m (lda k).
        let at = |i: usize, p: usize| if ta { av[p + i * k] } else { av[i + p * m] };
        let bt = |p: usize, j: usize| if tb { bv[j + p * n] } else { bv[p + j * k] };
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0f32;
                for p in 0..k {
                    acc += at(i, p) * bt(p, j);
                }
                cv[i + j * m] = alpha * acc
                    + if beta == 0.0 {
                        0.0
                    } else {
                        beta * cv[i + j * m]
                    };
            }
        }
        c.write(&cv)
    }
    fn axpy(
        &self,
        _: On,
        alpha: f32,
        x: &SymmBuffer,
        chunk: usize,
        y: &mut SymmBuffer,
    ) -> Result<()> {
        let (xv, mut yv) = (Self::get(x)?, Self::get(y)?);
        let xv = &xv[chunk * yv.len()..(chunk + 1) * yv.len()];
        yv.iter_mut().zip(xv).for_each(|(y, x)| *y += alpha * x);
        y.write(&yv)
    }
    fn scal(&self, _: On, alpha: f32, x: &mut SymmBuffer) -> Result<()> {
        let xv: Vec<f32> = Self::get(x)?.into_iter().map(|v| v * alpha).collect();
        x.write(&xv)
    }
    fn copy(&self, _: On, src: &SymmBuffer, dst: &mut SymmBuffer) -> Result<()> {
        dst.write(&Self::get(src)?)
    }
    fn sumsq_into(&self, _: On, x: &SymmBuffer, out: &mut SymmBuffer, slot: usize) -> Result<()> {
        let n = Self::get(x)?
            .iter()
            .map(|v| (*v as f64) * (*v as f64))
            .sum::<f64>() as f32;
        let mut o = Self::get(out)?;
        o[slot] = n;
        out.write(&o)
    }
    type Ev = ();
    fn record(&self, _: On) -> Result<()> {
        Ok(())
    }
    fn wait_for(&self, _: On, _: &()) -> Result<()> {
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    type Mark = std::time::Instant;
    fn mark(&self, _: On) -> Result<Self::Mark> {
        Ok(std::time::Instant::now())
    }
    fn elapsed_us(&self, from: &Self::Mark, to: &Self::Mark) -> Result<f64> {
        Ok(to.saturating_duration_since(*from).as_secs_f64() * 1e6)
    }
    fn read_sums(&self, out: &SymmBuffer) -> Result<Vec<f32>> {
        Self::get(out)
    }
}
