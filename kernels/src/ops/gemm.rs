//! The one place the CPU ops call the `gemm` crate (the multithreaded SIMD GEMM candle's own CPU matmul
//! uses): strided matrix views whose bounds are checked before the unsafe call.

use candle_core::WithDType;

/// A read-only strided matrix: element `(r, c)` is `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> View<'a, T> {
    /// Rows of `cols` elements, `rs` apart (`rs >= cols`), starting at `data[0]`.
    pub fn rows(data: &'a [T], rows: usize, cols: usize, rs: usize) -> Self {
        Self { data, rows, cols, rs, cs: 1 }
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        Self { rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs, ..self }
    }

    fn in_bounds(&self) -> bool {
        self.rows == 0 || self.cols == 0 || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.data.len()
    }
}

/// `dst (a.rows, b.cols)`, row-major with row stride `dst_rs`, becomes `beta * a @ b`, added to its
/// current value when `accumulate`. Only f32 and f64 reach here (the ops check the dtype first).
///
/// Panics if a view or `dst` is too short for its shape, or the inner dimensions differ: both are bugs
/// in the calling op, never a property of user input (which the ops validate before).
pub(crate) fn matmul<T: WithDType>(
    dst: &mut [T],
    dst_rs: usize,
    a: View<T>,
    b: View<T>,
    beta: T,
    accumulate: bool,
    parallel: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "matmul: inner dimensions {k} and {} differ", b.rows);
    assert!(a.in_bounds() && b.in_bounds(), "matmul: a view is out of bounds");
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * dst_rs + n <= dst.len() && dst_rs >= n, "matmul: dst is too short for ({m}, {n})");
    if k == 0 {
        if !accumulate {
            (0..m).for_each(|r| dst[r * dst_rs..][..n].fill(T::zero()));
        }
        return;
    }
    let threads = if parallel { candle_core::utils::get_num_threads().min(rayon::current_num_threads()) } else { 1 };
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the asserts above keep every address the strides reach inside `dst`, `a.data` and
    // `b.data`; `dst` is exclusively borrowed and does not alias the shared `a`, `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::one(),
            beta,
            false,
            false,
            false,
            par,
        );
    }
}
