//! The one gate every launch path goes through (`cuLaunchKernel`, `cuLaunchKernelEx`,
//! `cuLaunchCooperativeKernel`, `cuGraphLaunch`, each with its `_ptsz` form).
//!
//! Without an SM limit the gate is one relaxed atomic load and a branch. With one, a launch made
//! during the closed part of the device's duty cycle waits for the next period, never longer than
//! `GPUPOOL_VGPU_MAX_LAUNCH_WAIT_MS` (default one period): a rank held here while its peer's
//! collective kernel spins must get through, or the two deadlock. A launch that waited its whole
//! bound goes ahead and is counted.

use crate::controller::{self, bounded_wait, gate, PERIOD};
use crate::cuda::*;
use crate::layout;
use crate::process::{self, Process, GATE, GATE_PASS, GATE_REFUSED, GATE_THROTTLE};
use crate::sampler;
use crate::shared::now_ns;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Ok: launch now. Err: the code to return instead (the environment was refused).
#[inline]
pub fn before_launch(stream: CUstream) -> Result<(), CUresult> {
    match GATE.load(Ordering::Relaxed) {
        GATE_PASS => Ok(()),
        GATE_THROTTLE => {
            throttle(stream);
            Ok(())
        }
        GATE_REFUSED => Err(CUDA_ERROR_NOT_INITIALIZED),
        _ => match process::get() {
            Some(_) => before_launch(stream),
            None => Err(CUDA_ERROR_NOT_INITIALIZED),
        },
    }
}

#[cold]
fn throttle(_stream: CUstream) {
    let Some(process) = process::get() else {
        return;
    };
    let Some(index) = process.launch_device() else {
        return;
    };
    let Some(target) = process.config.sm_limit[index] else {
        return;
    };
    let Some(file) = process.file() else { return };
    // Our host PID must be in the file for the sampler to count our work.
    process.slot();
    let duty = ensure_record(process, index, target);
    sampler::ensure_running(process);
    let epoch = file
        .device_u64(index, layout::D_EPOCH_NS)
        .load(Ordering::Relaxed);
    let period = file
        .device_u64(index, layout::D_PERIOD_NS)
        .load(Ordering::Relaxed);
    let max_wait = process.config.max_launch_wait.as_nanos() as u64;
    let (wait, cut_short) = bounded_wait(gate(now_ns(), epoch, period, duty), max_wait);
    if wait > 0 {
        std::thread::sleep(Duration::from_nanos(wait));
    }
    if cut_short {
        file.device_u64(index, layout::D_BOUNDED_WAITS)
            .fetch_add(1, Ordering::Relaxed);
        log_debug!("a launch on device {index} waited its bound ({wait} ns) and went ahead");
    }
}

/// The device record's duty, set up by the first launch of the container on this device: the
/// period, the shared epoch, and the limit as the first duty.
fn ensure_record(process: &Process, index: usize, target: u32) -> u32 {
    let Some(file) = process.file() else {
        return controller::FULL_DUTY_PPM;
    };
    let duty = file.device_u32(index, layout::D_DUTY_PPM);
    let current = duty.load(Ordering::Acquire);
    if current != 0 {
        return current;
    }
    let _ = file
        .device_u64(index, layout::D_PERIOD_NS)
        .compare_exchange(
            0,
            PERIOD.as_nanos() as u64,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    let _ = file.device_u64(index, layout::D_EPOCH_NS).compare_exchange(
        0,
        now_ns(),
        Ordering::AcqRel,
        Ordering::Relaxed,
    );
    file.device_u32(index, layout::D_TARGET_PCT)
        .store(target, Ordering::Relaxed);
    let initial = controller::initial_duty(target);
    match duty.compare_exchange(0, initial, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => initial,
        Err(other) => other,
    }
}
