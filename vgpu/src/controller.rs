//! The SM limiter's arithmetic: the duty cycle a launch passes through and the closed loop that
//! sets it from measured utilisation. No I/O: the gate (`gate.rs`) and the sampler (`sampler.rs`)
//! feed these functions with clocks and NVML readings.
//!
//! Why a duty cycle on measured utilisation rather than a budget of blocks per launch: the cost of a
//! launch in SM time is not known when it is made (a block can run for a microsecond or a second),
//! so any per-launch cost model drifts with the workload. Utilisation is what the limit is stated
//! in; measuring it and correcting the open fraction of each period converges for any kernel mix.

use std::time::Duration;

/// One period of the duty cycle. Long enough that NVML's utilisation samples (about one per
/// 1/6 s on real cards) see several periods, short enough that a throttled process still launches
/// every tenth of a second.
pub const PERIOD: Duration = Duration::from_millis(100);

/// How often the closed loop reads utilisation and corrects the duty.
pub const CONTROL_INTERVAL: Duration = Duration::from_millis(200);

/// The duty never closes completely: a process always gets some time to make progress, and a
/// measurement of zero must be able to reopen it.
pub const MIN_DUTY_PPM: u32 = 1_000;
pub const FULL_DUTY_PPM: u32 = 1_000_000;

/// The shortest open window. A smaller duty opens this long once every few periods instead (the
/// same open fraction): a program refills its launch queue at each opening, so windows that are
/// short but frequent would let through a queue's worth of work every period, whatever the duty
/// (measured on the stand-in: graphs of 4 x 2 ms kernels, 8 launches in flight, stayed at ~49 %
/// under a 30 % limit until the duty fell below one window per period).
pub const MIN_WINDOW_NS: u64 = 10_000_000;

/// Gain of the loop, in the log domain: each interval the duty is multiplied by
/// `(target / measured) ^ GAIN`. Utilisation is about proportional to the duty, with a gain that
/// depends on the workload and on the other tenants (0.5 when the card is shared half and half, 1
/// alone, less when launch queues spill over the closed part): correcting by ratio converges for
/// any such gain, geometrically (factor 1 - GAIN per interval), and works the same at a duty of
/// 0.1 % as at 90 %.
pub const GAIN: f64 = 0.6;

/// The most one interval may change the duty by (each way): one noisy sample cannot swing it.
pub const MAX_STEP: f64 = 4.0;

/// What a launch does at this moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateDecision {
    Open,
    /// Closed until the next window opens, this many nanoseconds from now.
    Closed {
        reopens_in_ns: u64,
    },
}

/// Where `now` falls in the duty cycle that started at `epoch` (all processes of a container share
/// the epoch, so they open and close together). The cycle is one period, or several when the open
/// window would be shorter than [`MIN_WINDOW_NS`].
pub fn gate(now_ns: u64, epoch_ns: u64, period_ns: u64, duty_ppm: u32) -> GateDecision {
    if duty_ppm >= FULL_DUTY_PPM || period_ns == 0 || now_ns < epoch_ns {
        return GateDecision::Open;
    }
    let duty = duty_ppm.max(1) as u128;
    let window = period_ns as u128 * duty / FULL_DUTY_PPM as u128;
    let periods = if window >= MIN_WINDOW_NS as u128 {
        1
    } else {
        (MIN_WINDOW_NS as u128 * FULL_DUTY_PPM as u128).div_ceil(period_ns as u128 * duty)
    };
    let cycle = period_ns as u128 * periods;
    let open = cycle * duty / FULL_DUTY_PPM as u128;
    let phase = (now_ns - epoch_ns) as u128 % cycle;
    if phase < open {
        GateDecision::Open
    } else {
        GateDecision::Closed {
            reopens_in_ns: (cycle - phase) as u64,
        }
    }
}

/// The wait a launch actually does: until the gate reopens, never longer than `max_wait_ns`.
/// Returns the wait and whether the bound cut it short.
pub fn bounded_wait(decision: GateDecision, max_wait_ns: u64) -> (u64, bool) {
    match decision {
        GateDecision::Open => (0, false),
        GateDecision::Closed { reopens_in_ns } if reopens_in_ns <= max_wait_ns => {
            (reopens_in_ns, false)
        }
        GateDecision::Closed { .. } => (max_wait_ns, true),
    }
}

/// The duty to start from, before anything is measured: the limit itself (exact when the
/// container is alone on the card and saturates it).
pub fn initial_duty(target_pct: u32) -> u32 {
    clamp_duty(target_pct as f64 * 10_000.0)
}

/// One step of the closed loop: `measured_permille` is the container's SM utilisation over the
/// last interval, in tenths of a percent. (One percent is added to both sides so that an idle
/// measurement reopens the duty quickly instead of dividing by zero.)
pub fn next_duty(duty_ppm: u32, measured_permille: u32, target_pct: u32) -> u32 {
    let target = target_pct as f64 * 10.0 + 10.0;
    let measured = measured_permille as f64 + 10.0;
    let step = (target / measured)
        .powf(GAIN)
        .clamp(1.0 / MAX_STEP, MAX_STEP);
    clamp_duty(duty_ppm as f64 * step)
}

fn clamp_duty(ppm: f64) -> u32 {
    ppm.round().clamp(MIN_DUTY_PPM as f64, FULL_DUTY_PPM as f64) as u32
}

/// How the container's utilisation was measured in the last interval (stored in the shared file so
/// that tools and tests can see which loop is running).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measurement {
    /// NVML per-process samples summed over the container's host PIDs.
    PerProcess = 1,
    /// The whole card's utilisation: some PIDs are unknown, so others' work is counted as ours
    /// (conservative: the container gets at most its share, possibly less).
    DeviceWide = 2,
    /// No NVML: the duty is the limit, unmeasured.
    OpenLoop = 3,
    /// The DEFAULT policy with no other container on the card: not throttled.
    Uncontended = 4,
}

impl Measurement {
    pub fn from_code(code: u32) -> Option<Measurement> {
        Some(match code {
            1 => Measurement::PerProcess,
            2 => Measurement::DeviceWide,
            3 => Measurement::OpenLoop,
            4 => Measurement::Uncontended,
            _ => return None,
        })
    }
}

/// One NVML process utilisation sample (`nvmlProcessUtilizationSample_t`, the fields we use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessSample {
    pub pid: u32,
    pub timestamp_us: u64,
    pub sm_percent: u32,
}

/// The container's utilisation in permille from NVML's per-process samples: each of our PIDs'
/// samples averaged (NVML may return more than one per process), then summed over our PIDs, capped
/// at the whole card.
pub fn container_utilisation(samples: &[ProcessSample], ours: &[u32]) -> u32 {
    let mut total = 0u64;
    for &pid in ours {
        let mine: Vec<u64> = samples
            .iter()
            .filter(|s| s.pid == pid)
            .map(|s| s.sm_percent.min(100) as u64)
            .collect();
        if !mine.is_empty() {
            total += mine.iter().sum::<u64>() * 10 / mine.len() as u64;
        }
    }
    total.min(1000) as u32
}

/// The newest timestamp in a batch of samples, the cursor for the next query.
pub fn newest_timestamp(samples: &[ProcessSample], previous: u64) -> u64 {
    samples
        .iter()
        .map(|s| s.timestamp_us)
        .fold(previous, u64::max)
}

/// Whether another container's process is on the card: NVML's process list holds more PIDs than
/// ours can explain. `ours_known` are our processes' host PIDs, `ours_unknown` how many of our
/// processes have no known host PID (each may be any one entry of the list).
pub fn others_on_card(card_pids: &[u32], ours_known: &[u32], ours_unknown: usize) -> bool {
    let foreign = card_pids
        .iter()
        .filter(|pid| !ours_known.contains(pid))
        .count();
    foreign > ours_unknown
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 100_000_000;

    #[test]
    fn the_gate_is_open_for_the_duty_fraction_of_each_period() {
        let duty = 300_000; // 30 %
        assert_eq!(gate(0, 0, P, duty), GateDecision::Open);
        assert_eq!(gate(29_999_999, 0, P, duty), GateDecision::Open);
        assert_eq!(
            gate(30_000_000, 0, P, duty),
            GateDecision::Closed {
                reopens_in_ns: 70_000_000
            }
        );
        assert_eq!(
            gate(99_999_999, 0, P, duty),
            GateDecision::Closed { reopens_in_ns: 1 }
        );
        assert_eq!(gate(5 * P + 10, 0, P, duty), GateDecision::Open);
        assert_eq!(
            gate(5 * P + 40_000_000, 0, P, duty),
            GateDecision::Closed {
                reopens_in_ns: 60_000_000
            }
        );
    }

    #[test]
    fn the_phase_counts_from_the_shared_epoch() {
        let epoch = 1_000_000_000;
        assert_eq!(
            gate(epoch + 10_000_000, epoch, P, 300_000),
            GateDecision::Open
        );
        assert_eq!(
            gate(epoch + 50_000_000, epoch, P, 300_000),
            GateDecision::Closed {
                reopens_in_ns: 50_000_000
            }
        );
        // A clock reading before the epoch (another process wrote it a moment later) never blocks.
        assert_eq!(gate(epoch - 1, epoch, P, 300_000), GateDecision::Open);
    }

    #[test]
    fn a_full_duty_or_no_period_never_closes() {
        for now in [0, 1, P / 2, P - 1, 7 * P + 3] {
            assert_eq!(gate(now, 0, P, FULL_DUTY_PPM), GateDecision::Open);
            assert_eq!(gate(now, 0, 0, 1), GateDecision::Open);
        }
    }

    #[test]
    fn the_open_fraction_over_many_periods_equals_the_duty() {
        let duty = 370_000;
        let step = 10_000; // 10 µs resolution over 10 periods
        let open = (0..10 * P / step)
            .filter(|i| gate(i * step, 0, P, duty) == GateDecision::Open)
            .count();
        assert_eq!(open as u64, 10 * P / step * 37 / 100);
    }

    #[test]
    fn a_duty_below_one_window_per_period_opens_one_window_every_few_periods() {
        // 2 % of a 100 ms period is 2 ms, under the 10 ms window: 10 ms open every 5 periods.
        assert_eq!(MIN_WINDOW_NS, 10_000_000);
        let duty = 20_000;
        assert_eq!(gate(0, 0, P, duty), GateDecision::Open);
        assert_eq!(gate(9_999_999, 0, P, duty), GateDecision::Open);
        assert_eq!(
            gate(10_000_000, 0, P, duty),
            GateDecision::Closed {
                reopens_in_ns: 5 * P - 10_000_000
            }
        );
        assert_eq!(
            gate(P, 0, P, duty),
            GateDecision::Closed {
                reopens_in_ns: 4 * P
            }
        );
        assert_eq!(gate(5 * P + 10, 0, P, duty), GateDecision::Open);
        let step = 100_000;
        let open = (0..20 * P / step)
            .filter(|i| gate(i * step, 0, P, duty) == GateDecision::Open)
            .count();
        assert_eq!(
            open as u64,
            20 * P / step * 2 / 100,
            "the open fraction is still the duty"
        );
        // At the smallest duty: 10 ms once every 10 s.
        assert_eq!(
            gate(10_000_000, 0, P, MIN_DUTY_PPM),
            GateDecision::Closed {
                reopens_in_ns: 100 * P - 10_000_000
            }
        );
    }

    #[test]
    fn waits_are_cut_at_their_bound_and_say_so() {
        assert_eq!(bounded_wait(GateDecision::Open, 5), (0, false));
        assert_eq!(
            bounded_wait(GateDecision::Closed { reopens_in_ns: 4 }, 5),
            (4, false)
        );
        assert_eq!(
            bounded_wait(GateDecision::Closed { reopens_in_ns: 5 }, 5),
            (5, false)
        );
        assert_eq!(
            bounded_wait(
                GateDecision::Closed {
                    reopens_in_ns: 70_000_000
                },
                5_000_000
            ),
            (5_000_000, true)
        );
        assert_eq!(
            bounded_wait(GateDecision::Closed { reopens_in_ns: 9 }, 0),
            (0, true)
        );
    }

    #[test]
    fn the_loop_starts_at_the_limit_and_stays_within_bounds() {
        assert_eq!(initial_duty(30), 300_000);
        assert_eq!(initial_duty(0), MIN_DUTY_PPM);
        assert_eq!(next_duty(300_000, 300, 30), 300_000);
        assert_eq!(next_duty(MIN_DUTY_PPM, 1000, 1), MIN_DUTY_PPM);
        assert_eq!(next_duty(FULL_DUTY_PPM, 0, 99), FULL_DUTY_PPM);
    }

    #[test]
    fn over_use_closes_the_duty_and_under_use_opens_it_by_ratio() {
        let over = next_duty(300_000, 450, 30);
        assert_eq!(
            over,
            (300_000.0 * (310.0f64 / 460.0).powf(GAIN)).round() as u32
        );
        assert!(over < 300_000);
        let under = next_duty(300_000, 150, 30);
        assert_eq!(
            under,
            (300_000.0 * (310.0f64 / 160.0).powf(GAIN)).round() as u32
        );
        // An idle interval reopens fast, a saturated one closes fast, but never more than 4x.
        assert_eq!(next_duty(10_000, 0, 30), 40_000);
        assert_eq!(next_duty(400_000, 1000, 1), 100_000);
    }

    /// A simulated card where the container's utilisation is `gain` times its duty (another
    /// container takes the rest, or its launch queues spill over the closed part): the loop must
    /// settle on the target at any gain, within 25 intervals (5 s) even when the card starts
    /// saturated at 20 times the target's duty (a saturated reading understates the correction).
    #[test]
    fn the_loop_converges_for_any_plant_gain() {
        for gain in [0.5, 0.7, 1.0, 3.0, 20.0] {
            for target in [10, 30, 70] {
                let mut duty = initial_duty(target);
                let mut measured = 0;
                for _ in 0..25 {
                    measured = ((duty as f64 / 1e6) * gain * 1000.0).round().min(1000.0) as u32;
                    duty = next_duty(duty, measured, target);
                }
                let reachable = (gain * 1000.0).min(1000.0) as u32;
                let expected = (target * 10).min(reachable);
                assert!(
                    measured.abs_diff(expected) <= 5,
                    "gain {gain} target {target}: {measured} vs {expected}"
                );
            }
        }
    }

    #[test]
    fn utilisation_sums_our_processes_and_averages_each() {
        let samples = [
            ProcessSample {
                pid: 10,
                timestamp_us: 1,
                sm_percent: 20,
            },
            ProcessSample {
                pid: 10,
                timestamp_us: 2,
                sm_percent: 40,
            },
            ProcessSample {
                pid: 11,
                timestamp_us: 2,
                sm_percent: 15,
            },
            ProcessSample {
                pid: 99,
                timestamp_us: 3,
                sm_percent: 50,
            },
        ];
        assert_eq!(container_utilisation(&samples, &[10, 11]), 450);
        assert_eq!(container_utilisation(&samples, &[11]), 150);
        assert_eq!(container_utilisation(&samples, &[12]), 0);
        let saturated = [
            ProcessSample {
                pid: 1,
                timestamp_us: 1,
                sm_percent: 250,
            },
            ProcessSample {
                pid: 2,
                timestamp_us: 1,
                sm_percent: 90,
            },
        ];
        assert_eq!(container_utilisation(&saturated, &[1, 2]), 1000);
        assert_eq!(newest_timestamp(&samples, 0), 3);
        assert_eq!(newest_timestamp(&[], 7), 7);
    }

    #[test]
    fn another_container_is_seen_only_when_the_list_has_more_than_ours() {
        assert!(!others_on_card(&[10, 11], &[10, 11], 0));
        assert!(others_on_card(&[10, 11, 50], &[10, 11], 0));
        assert!(!others_on_card(&[10, 50], &[10], 1));
        assert!(others_on_card(&[10, 50, 51], &[10], 1));
        assert!(!others_on_card(&[], &[10], 0));
    }

    #[test]
    fn measurement_codes_round_trip() {
        for m in [
            Measurement::PerProcess,
            Measurement::DeviceWide,
            Measurement::OpenLoop,
            Measurement::Uncontended,
        ] {
            assert_eq!(Measurement::from_code(m as u32), Some(m));
        }
        assert_eq!(Measurement::from_code(0), None);
    }
}
