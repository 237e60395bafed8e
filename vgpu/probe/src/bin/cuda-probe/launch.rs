//! `launch`: kernels for a while, submitted the way a framework submits them (a bounded number of
//! launches in flight, or none, like PyTorch eager: the driver's launch queue paces the program),
//! and how many of them completed inside a window of wall-clock time shared by several processes.
//!
//! Completion is seen through events: one recorded after every launch, its completion time read
//! with `cuEventElapsedTime` against a reference event whose completion the probe saw happen (the
//! stream was idle, `cuEventSynchronize` returned) and timed on the host's clock. So the
//! completions of processes on one machine fall on one time line, on a real GPU as on the stand-in.
//! A graph's kernels are counted at its launch's event.

use super::{emit, with_result, Session};
use crate::cu::*;
use serde_json::json;
use std::ffi::c_void;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Events kept when nothing bounds the launches in flight: more than the launches a driver queues
/// (the stand-in's queue holds 1024), so reusing one almost never has to wait for it.
const UNBOUNDED_EVENTS: usize = 4096;

const CUDA_ERROR_NOT_READY: CUresult = 600;

/// `[start, start + length)` in nanoseconds since the Unix epoch, and the kernels completed in it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    pub start_ns: u64,
    pub length_ns: u64,
    pub kernels: u64,
}

impl Window {
    pub fn new(start_unix_ms: u64, length_ms: u64) -> Window {
        Window {
            start_ns: start_unix_ms * 1_000_000,
            length_ns: length_ms * 1_000_000,
            kernels: 0,
        }
    }

    pub fn end_ns(&self) -> u64 {
        self.start_ns + self.length_ns
    }

    /// Counts `kernels` that completed at `at_ns` if that is inside the window.
    pub fn count(&mut self, at_ns: u64, kernels: u64) {
        if (self.start_ns..self.end_ns()).contains(&at_ns) {
            self.kernels += kernels;
        }
    }

    /// The share of the window's time the counted kernels took (each a completed kernel of
    /// `kernel_ns` engine time): the share of the card the process got.
    pub fn busy_fraction(&self, kernel_ns: u64) -> f64 {
        self.kernels as f64 * kernel_ns as f64 / self.length_ns.max(1) as f64
    }
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// `--phases B,I,B,I,...`: milliseconds of work, then of idleness, alternately from the start;
/// after the last one, work until the end.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Phases {
    /// The idle stretches, as [start, end) from the program's start.
    idle: Vec<(Duration, Duration)>,
}

impl Phases {
    pub fn parse(list: &str) -> Result<Phases, String> {
        let mut at = Duration::ZERO;
        let mut idle = Vec::new();
        for (i, part) in list.split(',').enumerate() {
            let ms: u64 = part
                .trim()
                .parse()
                .map_err(|_| format!("--phases: {part:?} is not a number of milliseconds"))?;
            let length = Duration::from_millis(ms);
            if i % 2 == 1 {
                idle.push((at, at + length));
            }
            at += length;
        }
        Ok(Phases { idle })
    }

    /// When the idle phase the program is in ends (None: it works now).
    pub fn idle_until(&self, elapsed: Duration) -> Option<Duration> {
        self.idle
            .iter()
            .find(|(from, to)| *from <= elapsed && elapsed < *to)
            .map(|(_, to)| *to)
    }
}

/// One launch's event: its slot, and the kernels it completes.
struct Pending {
    event: Handle,
    kernels: u64,
}

impl Session<'_> {
    pub(super) fn launch(&self) -> Result<(), String> {
        let mode = self.opts.str("mode").unwrap_or("eager").to_string();
        let seconds = self
            .opts
            .str("seconds")
            .map(|s| s.parse::<f64>().map_err(|_| "--seconds: a number"))
            .transpose()?
            .unwrap_or(2.0);
        let kernel_us = self.opts.num_or("kernel-us", 1000)?;
        let grid = self.opts.num_or("grid", 1)? as u32;
        let block = self.opts.num_or("block", 128)? as u32;
        let nodes = self.opts.num_or("graph-nodes", 4)?;
        let inflight = self.opts.num_or("inflight", 2)? as usize;
        let report = self.opts.num("report-ms")?;
        let drain = !self.opts.flag("no-drain");
        let phases = match self.opts.str("phases") {
            Some(list) => Phases::parse(list)?,
            None => Phases::default(),
        };
        let mut window = match (
            self.opts.num("window-start-unix-ms")?,
            self.opts.num("window-ms")?,
        ) {
            (Some(start), Some(length)) if length > 0 => Some(Window::new(start, length)),
            (None, None) => None,
            _ => return Err("--window-start-unix-ms and --window-ms (> 0) go together".into()),
        };
        let report_line = |r: CUresult,
                           launches: u64,
                           kernels: u64,
                           elapsed: f64,
                           max_call: f64,
                           sum_call: f64,
                           window: Option<(Window, bool)>| {
            let mut line = json!({
                "op": "launch",
                "mode": mode,
                "inflight": inflight,
                "seconds": elapsed,
                "kernel_us": kernel_us,
                "launches": launches,
                "kernels": kernels,
                "throughput": kernels as f64 / elapsed.max(1e-9),
                "busy_fraction": kernels as f64 * kernel_us as f64 / 1e6 / elapsed.max(1e-9),
                "launch_call_max_ms": max_call * 1e3,
                "launch_call_mean_us": if launches > 0 { sum_call / launches as f64 * 1e6 } else { 0.0 },
            });
            if let Some((w, covered)) = window {
                line["window_start_unix_ms"] = json!(w.start_ns / 1_000_000);
                line["window_ms"] = json!(w.length_ns / 1_000_000);
                line["window_kernels"] = json!(w.kernels);
                line["window_busy_fraction"] = json!(w.busy_fraction(kernel_us * 1000));
                line["window_covered"] = json!(covered);
                line["completion"] = json!("events");
            }
            emit(with_result(line, r))
        };
        let f = match self.module_function() {
            Ok(f) => f,
            Err(r) => {
                report_line(r, 0, 0, 0.0, 0.0, 0.0, window.map(|w| (w, false)));
                return Ok(());
            }
        };
        let cu = self.cu;
        let stream = self.stream();
        let mut ns: u64 = kernel_us * 1000;
        let graphed = mode == "graph" || mode == "capture";
        let exec = if graphed {
            match self.graph(f, &mut ns, nodes, grid, block, mode == "capture") {
                Ok(e) => Some(e),
                Err(r) => {
                    report_line(r, 0, 0, 0.0, 0.0, 0.0, window.map(|w| (w, false)));
                    return Ok(());
                }
            }
        } else {
            None
        };
        let per_launch = if graphed { nodes } else { 1 };
        let ring = if inflight > 0 {
            inflight
        } else {
            UNBOUNDED_EVENTS
        };
        let event_create = need!(cu.event_create());
        let event_record = need!(cu.event_record());
        let event_sync = need!(cu.event_synchronize());
        let event_query = need!(cu.event_query());
        let elapsed = need!(cu.event_elapsed_time());
        let new_event = || {
            let mut e: Handle = std::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            unsafe { event_create(&mut e, 0) };
            e
        };
        // The reference: recorded on the stream before any launch of ours, its completion seen.
        let reference = new_event();
        // SAFETY: events of ours, the stream in use.
        let reference_ns = unsafe {
            event_record(reference, stream);
            event_sync(reference);
            unix_ns()
        };
        let events: Vec<Handle> = (0..ring).map(|_| new_event()).collect();
        let mut slots: Vec<Option<Pending>> = (0..ring).map(|_| None).collect();
        // When a completed launch's event says its kernels completed.
        let timeline_bin_ms = self.opts.num("timeline-ms")?.filter(|&b| b > 0);
        let mut timeline: Vec<u64> = Vec::new();
        let harvest = |p: &Pending, window: &mut Option<Window>, timeline: &mut Vec<u64>| {
            let mut ms = 0f32;
            // SAFETY: two recorded events of ours.
            if unsafe { elapsed(&mut ms, reference, p.event) } == 0 {
                let at_ns = reference_ns + (ms as f64 * 1e6) as u64;
                if let Some(w) = window.as_mut() {
                    w.count(at_ns, p.kernels);
                }
                if let Some(bin_ms) = timeline_bin_ms {
                    let bin = (at_ns.saturating_sub(reference_ns) / (bin_ms * 1_000_000)) as usize;
                    if timeline.len() <= bin {
                        timeline.resize(bin + 1, 0);
                    }
                    timeline[bin] += p.kernels;
                }
            }
        };
        let launch_kernel = need!(cu.launch_kernel());
        let mut params: [*mut c_void; 1] = [&mut ns as *mut u64 as *mut c_void];
        let start = Instant::now();
        let start_ns = unix_ns();
        let deadline = start + Duration::from_secs_f64(seconds);
        let mut next_report = report.map(|ms| start + Duration::from_millis(ms));
        let (mut launches, mut result, mut max_call, mut sum_call) = (0u64, 0, 0f64, 0f64);
        while Instant::now() < deadline {
            if let Some(idle_until) = phases.idle_until(start.elapsed()) {
                // An idle phase: nothing launched (the queue drains by itself), as a server
                // between requests or a training step waiting for its data.
                std::thread::sleep((start + idle_until).saturating_duration_since(Instant::now()));
                continue;
            }
            let slot = launches as usize % ring;
            if let Some(p) = slots[slot].take() {
                // SAFETY: an event recorded below. Bounded: wait for the launch `inflight` back;
                // unbounded: it is almost always complete already.
                unsafe {
                    if inflight > 0 || event_query(p.event) == CUDA_ERROR_NOT_READY {
                        event_sync(p.event);
                    }
                }
                harvest(&p, &mut window, &mut timeline);
            }
            let t = Instant::now();
            // SAFETY: the ABIs of cuda.h 12.9 for these entry points; params outlive the calls.
            let r = unsafe {
                match mode.as_str() {
                    "eager" => launch_kernel(
                        f,
                        grid,
                        1,
                        1,
                        block,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    ),
                    "cooperative" => need!(cu.launch_cooperative_kernel())(
                        f,
                        grid,
                        1,
                        1,
                        block,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                    ),
                    "ex" => {
                        let cfg = LaunchConfig {
                            grid: [grid, 1, 1],
                            block: [block, 1, 1],
                            shared_mem_bytes: 0,
                            stream,
                            attrs: std::ptr::null_mut(),
                            num_attrs: 0,
                        };
                        need!(cu.launch_kernel_ex())(
                            &cfg,
                            f,
                            params.as_mut_ptr(),
                            std::ptr::null_mut(),
                        )
                    }
                    _ if graphed => need!(cu.graph_launch())(exec.expect("graph made"), stream),
                    other => return Err(format!("unknown --mode {other}")),
                }
            };
            let call = t.elapsed().as_secs_f64();
            max_call = max_call.max(call);
            sum_call += call;
            if r != 0 {
                result = r;
                break;
            }
            // SAFETY: an event of ours on the stream in use.
            unsafe { event_record(events[slot], stream) };
            slots[slot] = Some(Pending {
                event: events[slot],
                kernels: per_launch,
            });
            launches += 1;
            if let Some(at) = next_report {
                if Instant::now() >= at {
                    emit(
                        json!({"op": "progress", "elapsed_ms": start.elapsed().as_millis() as u64, "kernels": launches * per_launch}),
                    );
                    next_report = Some(at + Duration::from_millis(report.unwrap_or(1000)));
                }
            }
        }
        let end_ns = unix_ns();
        let covered = window.is_some_and(|w| start_ns <= w.start_ns && end_ns >= w.end_ns());
        if drain {
            // SAFETY: the stream in use.
            unsafe { need!(cu.stream_synchronize())(stream) };
        } else if let Some(w) = window {
            // What is still queued completes after the window, once the window is over.
            let now = unix_ns();
            if now < w.end_ns() {
                std::thread::sleep(Duration::from_nanos(w.end_ns() - now));
            }
        }
        for p in slots.iter().flatten() {
            // SAFETY: recorded events of ours.
            if unsafe { event_query(p.event) } == 0 {
                harvest(p, &mut window, &mut timeline);
            }
        }
        if let Some(bin_ms) = timeline_bin_ms {
            emit(json!({
                "op": "timeline",
                "start_unix_ms": reference_ns / 1_000_000,
                "bin_ms": bin_ms,
                "kernel_us": kernel_us,
                "kernels": timeline,
            }));
        }
        report_line(
            result,
            launches,
            launches * per_launch,
            start.elapsed().as_secs_f64(),
            max_call,
            sum_call,
            window.map(|w| (w, covered)),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Phases, Window};
    use std::time::Duration;

    #[test]
    fn phases_alternate_work_and_idleness_from_the_start() {
        let p = Phases::parse("100,50,0,30").unwrap();
        let ms = Duration::from_millis;
        assert_eq!(p.idle_until(ms(99)), None);
        assert_eq!(p.idle_until(ms(100)), Some(ms(150)));
        assert_eq!(p.idle_until(ms(150)), Some(ms(180)), "no work in between");
        assert_eq!(p.idle_until(ms(180)), None);
        assert!(Phases::parse("10,x").is_err());
    }

    #[test]
    fn a_window_counts_completions_inside_it_only() {
        let mut w = Window::new(1_000, 3_000);
        w.count(999_999_999, 4);
        w.count(1_000_000_000, 1);
        w.count(3_999_999_999, 2);
        w.count(4_000_000_000, 8);
        assert_eq!(w.kernels, 3);
        // 1500 kernels of 2 ms in 3 s: the whole card.
        w.kernels = 1500;
        assert!((w.busy_fraction(2_000_000) - 1.0).abs() < 1e-9);
    }
}
