//! Checked rounding helpers. None of them can overflow silently.

/// `true` if `x` is a power of two (0 is not).
pub(crate) fn is_pow2(x: u64) -> bool {
    x.is_power_of_two()
}

/// Round `x` up to a multiple of the power of two `align`.
///
/// Returns `None` if the result does not fit in `u64` or `align` is not a power of two.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    if !is_pow2(align) {
        return None;
    }
    let mask = align - 1;
    x.checked_add(mask).map(|y| y & !mask)
}

#[cfg(test)]
#[path = "../../tests/unit/core/align.rs"]
mod tests;
