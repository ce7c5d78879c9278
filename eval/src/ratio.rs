//! `num / den`, or None where the denominator is 0: every rate of the reports, so that a rate with
//! nothing to count is "-", never 0.

pub fn ratio(num: usize, den: usize) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}
