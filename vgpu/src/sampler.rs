//! The closed loop of the SM limiter: every control interval one process of the container (the
//! one that takes the device record's lock first) measures the container's utilisation through
//! NVML and writes the next duty into the shared file; every process's gate reads it.
//!
//! A thread per process, started by its first throttled launch, does the sampling. It holds no
//! lock of ours across an NVML call except the device record's OFD lock (another process that
//! finds it taken simply skips this interval).

use crate::controller::{
    self, container_utilisation, newest_timestamp, next_duty, others_on_card, Measurement,
    CONTROL_INTERVAL,
};
use crate::env::UtilizationPolicy;
use crate::layout;
use crate::process::Process;
use crate::shared::now_ns;
use std::sync::atomic::{AtomicBool, Ordering};

pub fn ensure_running(process: &'static Process) {
    // A load first: this runs on every throttled launch, and a swap would bounce the cache line.
    if process.sampler_started.load(Ordering::Relaxed)
        || process.sampler_started.swap(true, Ordering::AcqRel)
    {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gpupool-vgpu-sm".into())
        .spawn(move || loop {
            std::thread::sleep(CONTROL_INTERVAL / 4);
            if std::panic::catch_unwind(|| sample_all(process)).is_err() {
                log_error!("the SM sampler failed; the duty stays as it is");
            }
        });
    if let Err(error) = spawned {
        log_error!("cannot start the SM sampler thread ({error}): SM limits run open loop");
    }
}

fn sample_all(process: &Process) {
    for (index, target) in process.config.sm_limit.iter().enumerate() {
        if let Some(target) = target {
            sample_device(process, index, *target);
        }
    }
}

static OPEN_LOOP_WARNED: AtomicBool = AtomicBool::new(false);

/// NVML's sample timestamps are the CPU's wall clock in microseconds.
pub fn wall_clock_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn sample_device(process: &Process, index: usize, target: u32) {
    let Some(file) = process.file() else { return };
    let interval = CONTROL_INTERVAL.as_nanos() as u64;
    let last_sample = file.device_u64(index, layout::D_LAST_SAMPLE_NS);
    if now_ns().saturating_sub(last_sample.load(Ordering::Acquire)) < interval {
        return;
    }
    let duty_field = file.device_u32(index, layout::D_DUTY_PPM);
    if duty_field.load(Ordering::Acquire) == 0 {
        return; // no launch on this device yet
    }
    let Some(_sampler) = file.try_lock_device(index) else {
        return;
    };
    let now = now_ns();
    if now.saturating_sub(last_sample.load(Ordering::Acquire)) < interval {
        return; // another process sampled while we took the lock
    }
    let duty = duty_field.load(Ordering::Acquire);
    let previous = Measurement::from_code(
        file.device_u32(index, layout::D_MODE)
            .load(Ordering::Relaxed),
    );
    let cursor_field = file.device_u64(index, layout::D_LAST_SEEN_US);
    let mut cursor = cursor_field.load(Ordering::Relaxed);

    let (mode, measured, next) = 'measure: {
        let (Some(nvml), Some(device)) = (process.nvml(), process.nvml_device(index)) else {
            if !OPEN_LOOP_WARNED.swap(true, Ordering::Relaxed) {
                log_warn!("no NVML: the SM limit runs open loop (open {target}% of each period, unmeasured)");
            }
            break 'measure (Measurement::OpenLoop, 0, controller::initial_duty(target));
        };
        let (known, unknown) = file.host_pids();
        let contended = process.config.policy == UtilizationPolicy::Force || {
            let on_card: Vec<u32> = nvml
                .processes(device)
                .unwrap_or_default()
                .iter()
                .map(|p| p.pid)
                .collect();
            others_on_card(&on_card, &known, unknown)
        };
        if !contended {
            break 'measure (Measurement::Uncontended, 0, controller::FULL_DUTY_PPM);
        }
        let per_process = unknown == 0 && !known.is_empty();
        // Starting (or coming back from "not throttled", or open loop): start again from the
        // limit, and measure only from now on. Samples of the time before describe a card that
        // was not throttled; correcting with them overshoots (seen on the stand-in: a first
        // reading diluted by idle periods before the first launch opened a 30 % duty to 42 %).
        if !matches!(
            previous,
            Some(Measurement::PerProcess | Measurement::DeviceWide)
        ) {
            cursor = wall_clock_us();
            let mode = if per_process {
                Measurement::PerProcess
            } else {
                Measurement::DeviceWide
            };
            break 'measure (mode, u32::MAX, controller::initial_duty(target));
        }
        let start = duty;
        if per_process {
            match nvml.process_utilisation(device, cursor) {
                // No new sample from anyone: nothing to correct with.
                Ok(samples) if samples.is_empty() => {
                    break 'measure (Measurement::PerProcess, u32::MAX, start)
                }
                Ok(samples) => {
                    cursor = newest_timestamp(&samples, cursor);
                    let measured = container_utilisation(&samples, &known);
                    break 'measure (
                        Measurement::PerProcess,
                        measured,
                        next_duty(start, measured, target),
                    );
                }
                Err(_unsupported) => {}
            }
        }
        match nvml.device_utilisation(device) {
            Some(percent) => {
                let measured = percent.min(100) * 10;
                (
                    Measurement::DeviceWide,
                    measured,
                    next_duty(start, measured, target),
                )
            }
            None => (Measurement::OpenLoop, 0, controller::initial_duty(target)),
        }
    };

    if previous != Some(mode) {
        log_info!("SM limit on device {index}: {target}%, measured by {mode:?}");
    }
    duty_field.store(next, Ordering::Release);
    if measured != u32::MAX {
        file.device_u32(index, layout::D_MEASURED_PERMILLE)
            .store(measured, Ordering::Relaxed);
    }
    file.device_u32(index, layout::D_MODE)
        .store(mode as u32, Ordering::Relaxed);
    file.device_u32(index, layout::D_CONTENDED)
        .store((mode != Measurement::Uncontended) as u32, Ordering::Relaxed);
    cursor_field.store(cursor, Ordering::Relaxed);
    last_sample.store(now, Ordering::Release);
}
