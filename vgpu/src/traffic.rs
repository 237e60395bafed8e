//! Seeded traffic for the scheduler's tests and `vgpu-bench --soak` (pure, never used by the
//! preloaded library itself): stretches of work and idleness drawn log-uniformly, so that a run
//! has as many millisecond gaps as minute-long ones, and repeats exactly with its seed.

/// A small linear congruential generator: enough for traffic, and the same everywhere.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    /// Log-uniform in [lo, hi].
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        let f = (self.next_u64() % 1_000_000) as f64 / 1_000_000.0;
        ((lo as f64).ln() + f * ((hi as f64).ln() - (lo as f64).ln())).exp() as u64
    }

    /// [start, end) stretches of work up to `end`: an idle stretch first, then work and idleness
    /// alternately, each drawn from its range.
    pub fn phases(&mut self, end: u64, busy: (u64, u64), idle: (u64, u64)) -> Vec<(u64, u64)> {
        let mut t = self.between(idle.0, idle.1);
        let mut phases = Vec::new();
        while t < end {
            let b = self.between(busy.0, busy.1);
            phases.push((t, (t + b).min(end)));
            t += b + self.between(idle.0, idle.1);
        }
        phases
    }
}

/// Stretches of work as alternating lengths from 0, work first (`cuda-probe launch --phases`):
/// [(5, 8)] is 0 of work, 5 idle, 3 of work.
pub fn alternating(phases: &[(u64, u64)]) -> Vec<u64> {
    let mut lengths = vec![0];
    let mut at = 0;
    for &(start, end) in phases {
        lengths.push(start.saturating_sub(at));
        lengths.push(end.saturating_sub(start));
        at = end;
    }
    lengths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_ordered_and_alternate() {
        let phases = Lcg(7).phases(1_000_000, (10, 1_000), (1, 10_000));
        assert!(phases.windows(2).all(|w| w[0].1 < w[1].0));
        assert_eq!(alternating(&[(5, 8), (10, 20)]), vec![0, 5, 3, 2, 10]);
    }
}
