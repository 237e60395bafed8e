//! Latency summaries (pure): nearest-rank percentiles over recorded samples.

use std::time::Duration;

use serde::Serialize;

/// p50 / p95 / p99 / max of a set of latencies, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub p50_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

/// The nearest-rank percentile `p` (0..=100) of `sorted`, which must be sorted ascending: the
/// smallest sample with at least p% of the samples at or below it.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

pub fn summarize(samples: &[Duration]) -> Summary {
    if samples.is_empty() {
        return Summary::default();
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let total: Duration = sorted.iter().sum();
    Summary {
        count: sorted.len(),
        p50_us: micros(percentile(&sorted, 50.0)),
        p95_us: micros(percentile(&sorted, 95.0)),
        p99_us: micros(percentile(&sorted, 99.0)),
        max_us: micros(*sorted.last().expect("not empty")),
        mean_us: micros(total) / sorted.len() as f64,
    }
}

/// The median of a few values (runs of one measurement); the lower middle for an even count.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[(sorted.len() - 1) / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(values: &[u64]) -> Vec<Duration> {
        values.iter().map(|v| Duration::from_millis(*v)).collect()
    }

    #[test]
    fn nearest_rank_percentiles_of_one_to_hundred() {
        let sorted = ms(&(1..=100).collect::<Vec<_>>());
        assert_eq!(percentile(&sorted, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&sorted, 95.0), Duration::from_millis(95));
        assert_eq!(percentile(&sorted, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&sorted, 100.0), Duration::from_millis(100));
        assert_eq!(percentile(&sorted, 0.0), Duration::from_millis(1));
    }

    #[test]
    fn summary_sorts_its_input_and_reports_the_tail() {
        let summary = summarize(&ms(&[9, 1, 5, 3, 7]));
        assert_eq!(summary.count, 5);
        assert_eq!(summary.p50_us, 5_000.0);
        assert_eq!(summary.p99_us, 9_000.0);
        assert_eq!(summary.max_us, 9_000.0);
        assert_eq!(summary.mean_us, 5_000.0);
    }

    #[test]
    fn a_single_slow_call_in_a_hundred_shows_only_at_the_max() {
        let mut samples = ms(&[1; 99]);
        samples.push(Duration::from_millis(500));
        let summary = summarize(&samples);
        assert_eq!(summary.p99_us, 1_000.0);
        assert_eq!(summary.max_us, 500_000.0);
    }

    #[test]
    fn empty_input_is_all_zero() {
        assert_eq!(summarize(&[]), Summary::default());
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn median_of_runs() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.0);
    }
}
