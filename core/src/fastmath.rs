//! `e^x` in f32 without a libm call per value, for the loops that take one per vocabulary entry or
//! per attention score: the draft's greedy confidence, the scorer's softmax and SiLU.

/// `e^x`, within 1 ulp of libm's `expf` for `x` in [-87, 88] (Cephes' `expf`: `x = n ln 2 + r`, a
/// polynomial for `e^r`, `2^n` from the exponent bits). Branch-free, so a loop over it vectorises.
/// Outside that range the argument is clamped: below -87 it returns `e^-87` (about 1.6e-38, where
/// `e^x` leaves f32's normal range), above 88 `e^88` (about 1.7e38); NaN stays NaN.
#[inline]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    // ln 2 in two parts, so that `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * r * r + r + 1.0;
    // n is in [-126, 127] after the clamp: a normal power of two.
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_one_ulp_of_libm_over_its_range() {
        let mut worst = 0;
        for i in 0..=1_750_000 {
            let x = -87.0 + i as f32 * 1e-4;
            // Positive floats order as their bits: the distance in bits is the distance in ulp.
            let (fast, libm) = (exp(x).to_bits(), x.exp().to_bits());
            worst = worst.max(fast.abs_diff(libm));
        }
        assert!(worst <= 1, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn clamps_outside_the_range() {
        assert!(exp(f32::NEG_INFINITY) > 0.0 && exp(f32::NEG_INFINITY) < 2e-38);
        assert!(exp(1000.0).is_finite() && exp(1000.0) > 1e38);
        assert!(exp(f32::NAN).is_nan());
    }
}
