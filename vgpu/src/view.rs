//! The memory a limited process is shown, from one function so that every view agrees.
//!
//! `cuMemGetInfo`, `cuDeviceTotalMem`, `nvmlDeviceGetMemoryInfo` and its v2 all answer from
//! [`memory_view`]. Frameworks compare these answers with each other (vLLM's profiler, PyTorch's
//! caching allocator); two views that disagree, or a `free` that wraps around below zero, make them
//! fail in ways that look like driver bugs.

/// Total, free and used bytes as a limited process sees one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryView {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `limit`: the container's limit on the device; `charged`: what the container's processes hold
/// on it, context memory included; `real_free`: what the card itself has free.
///
/// `free` is the smaller of what the limit leaves and what the card has (another tenant may hold
/// the rest of the card), and saturates at 0 when context memory has pushed `charged` past the
/// limit. `used` is derived, so `used + free == total` always holds.
pub fn memory_view(limit: u64, charged: u64, real_free: u64) -> MemoryView {
    let free = limit.saturating_sub(charged).min(real_free);
    MemoryView {
        total: limit,
        free,
        used: limit - free,
    }
}

/// The view in the 32-bit types of the v1 entry points (`cuMemGetInfo`, `cuDeviceTotalMem`
/// without `_v2`): clamped, never wrapped.
pub fn clamp_u32(bytes: u64) -> u32 {
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_the_total_and_charges_come_off_it() {
        let v = memory_view(1000, 300, 10_000);
        assert_eq!(
            v,
            MemoryView {
                total: 1000,
                free: 700,
                used: 300
            }
        );
    }

    #[test]
    fn free_never_exceeds_what_the_card_really_has() {
        let v = memory_view(1000, 300, 200);
        assert_eq!(
            v,
            MemoryView {
                total: 1000,
                free: 200,
                used: 800
            }
        );
    }

    #[test]
    fn usage_past_the_limit_saturates_instead_of_wrapping() {
        let v = memory_view(1000, 1300, 10_000);
        assert_eq!(
            v,
            MemoryView {
                total: 1000,
                free: 0,
                used: 1000
            }
        );
        let v = memory_view(1000, u64::MAX, 0);
        assert_eq!(
            v,
            MemoryView {
                total: 1000,
                free: 0,
                used: 1000
            }
        );
    }

    #[test]
    fn used_plus_free_is_always_total() {
        for (limit, charged, real) in [
            (0, 0, 0),
            (5, 0, 9),
            (5, 5, 9),
            (5, 9, 9),
            (u64::MAX, 1, u64::MAX),
            (7, 3, 1),
        ] {
            let v = memory_view(limit, charged, real);
            assert_eq!(v.used + v.free, v.total, "{limit} {charged} {real}");
            assert!(v.free <= real && v.free <= limit);
        }
    }

    #[test]
    fn v1_views_clamp_to_32_bits() {
        assert_eq!(clamp_u32(5), 5);
        assert_eq!(clamp_u32(1 << 40), u32::MAX);
    }
}
