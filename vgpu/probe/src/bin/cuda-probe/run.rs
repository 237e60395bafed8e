//! The subcommands.

use crate::cu::*;
use crate::nvml::{nvml_error, Nvml, MEMORY_V2};
use crate::Opts;
use serde_json::{json, Value};
use std::cell::OnceCell;
use std::ffi::{c_void, CString};
use std::io::Write;
use std::time::{Duration, Instant};

/// A kernel that spins for its first parameter in nanoseconds (`%globaltimer`): real PTX, so the
/// probe measures the same thing on a GPU; the stand-in reads its `.entry` and runs it as timed work.
pub const PTX: &str = ".version 7.0
.target sm_70
.address_size 64

.visible .entry gpupool_spin(
	.param .u64 gpupool_spin_param_0
)
{
	.reg .pred 	%p<2>;
	.reg .b64 	%rd<5>;

	ld.param.u64 	%rd1, [gpupool_spin_param_0];
	mov.u64 	%rd2, %globaltimer;
$L__BB0_1:
	mov.u64 	%rd3, %globaltimer;
	sub.s64 	%rd4, %rd3, %rd2;
	setp.lt.u64 	%p1, %rd4, %rd1;
	@%p1 bra 	$L__BB0_1;
	ret;
}
";

const CU_STREAM_PER_THREAD: usize = 0x2;

/// Set in the child of `fork`: its lines say so.
static FORKED_CHILD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn emit(mut v: Value) {
    if FORKED_CHILD.load(std::sync::atomic::Ordering::Relaxed) {
        v["who"] = json!("child");
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

pub(crate) fn with_result(mut v: Value, code: CUresult) -> Value {
    v["result"] = json!(code);
    v["error"] = json!(error_name(code));
    v
}

/// Ends the run when an entry point the subcommand needs is not there.
macro_rules! need {
    ($call:expr) => {
        match $call {
            Ok(f) => f,
            Err(m) => {
                let mut v = m.json();
                v["op"] = json!("missing");
                emit(v);
                std::process::exit(3);
            }
        }
    };
}

pub(crate) struct Session<'a> {
    cu: &'a Cu,
    opts: &'a Opts,
    device: i32,
    /// The context `setup` made (primary or created), for `--end-context`.
    context: std::cell::Cell<Handle>,
    stream: OnceCell<Handle>,
    pool: OnceCell<Handle>,
    nvml: OnceCell<Option<Nvml>>,
}

pub fn run(sub: &str, opts: &Opts, cu: Cu) -> i32 {
    let device = match opts.num_or("device", 0) {
        Ok(d) => d as i32,
        Err(e) => return usage(e),
    };
    let s = Session {
        cu: &cu,
        opts,
        device,
        context: std::cell::Cell::new(std::ptr::null_mut()),
        stream: OnceCell::new(),
        pool: OnceCell::new(),
        nvml: OnceCell::new(),
    };
    let known = [
        "devices",
        "alloc",
        "fill",
        "free",
        "views",
        "hold",
        "getproc",
        "launch",
        "fork",
        "dlsym",
        "bench-launch",
        "bench-alloc",
        "capture-rules",
        "churn",
        "fork-storm",
    ];
    if !known.contains(&sub) {
        return usage(format!("unknown subcommand {sub:?} (see --help)"));
    }
    // Lookups alone need no driver state.
    if sub != "getproc" && sub != "dlsym" {
        s.setup(sub == "devices");
    }
    let code = match sub {
        "devices" => s.devices(),
        "alloc" => s.alloc(),
        "fill" => s.fill(),
        "free" => s.free(),
        "views" => {
            emit(s.views());
            Ok(())
        }
        "hold" => s.hold(),
        "getproc" => s.getproc(),
        "launch" => s.launch(),
        "fork" => s.fork(),
        "dlsym" => s.dlsym(),
        "bench-launch" => s.bench_launch(),
        "bench-alloc" => s.bench_alloc(),
        "capture-rules" => s.capture_rules(),
        "churn" => s.churn(),
        "fork-storm" => s.fork_storm(),
        _ => unreachable!(),
    };
    emit(json!({"op": "resolved", "entry_points": cu.resolutions()}));
    match code {
        Ok(()) => 0,
        Err(e) => usage(e),
    }
}

pub fn usage(message: String) -> i32 {
    emit(json!({"op": "usage_error", "message": message}));
    2
}

fn uuid_string(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

impl Session<'_> {
    /// cuInit and the context, as the runtime makes them; failures are reported and the
    /// subcommand goes on (its own calls then show what the driver answers).
    fn setup(&self, always_report: bool) {
        if self.opts.flag("no-init") {
            return;
        }
        self.init_and_context(always_report, self.opts.str("context").unwrap_or("primary"));
    }

    fn init_and_context(&self, always_report: bool, context: &str) {
        // SAFETY: cuInit(0).
        let r = unsafe { need!(self.cu.init())(0) };
        if r != 0 || always_report {
            let mut version = 0;
            let mut count = 0;
            // SAFETY: valid out-pointers.
            unsafe {
                if let Ok(f) = self.cu.driver_get_version() {
                    f(&mut version);
                }
                if let Ok(f) = self.cu.device_get_count() {
                    f(&mut count);
                }
            }
            emit(with_result(
                json!({"op": "init", "driver_version": version, "count": count}),
                r,
            ));
        }
        if r != 0 {
            return;
        }
        // A moment between cuInit and the context (a test changes the world meanwhile).
        if let Ok(Some(ms)) = self.opts.num("pause-after-init-ms") {
            emit(json!({"op": "paused_after_init", "ms": ms}));
            std::thread::sleep(Duration::from_millis(ms));
        }
        self.make_context(context);
    }

    /// A context made current: `primary`, `create` or `none` (failures reported as a `context`
    /// line).
    fn make_context(&self, how: &str) {
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: the ABIs follow the lookup (see Cu::abi); out-pointers are valid.
        let r = unsafe {
            match how {
                "none" => return,
                "primary" => {
                    let r = need!(self.cu.primary_ctx_retain())(&mut ctx, self.device);
                    if r == 0 {
                        need!(self.cu.ctx_set_current())(ctx)
                    } else {
                        r
                    }
                }
                "create" => {
                    if self.cu.abi(12050, 3020) {
                        need!(self.cu.ctx_create_v4())(
                            &mut ctx,
                            std::ptr::null_mut(),
                            0,
                            self.device,
                        )
                    } else if self.cu.abi(11040, 3020) {
                        need!(self.cu.ctx_create_v3())(
                            &mut ctx,
                            std::ptr::null_mut(),
                            0,
                            0,
                            self.device,
                        )
                    } else {
                        need!(self.cu.ctx_create_v2())(&mut ctx, 0, self.device)
                    }
                }
                other => {
                    usage(format!("unknown --context {other}"));
                    std::process::exit(2);
                }
            }
        };
        self.context.set(ctx);
        if r != 0 {
            emit(with_result(json!({"op": "context", "how": how}), r));
        }
    }

    /// `--end-context destroy|reset|release`: ends the context `setup` made, as `cudaDeviceReset`
    /// or a framework's teardown does; the driver frees everything allocated in it.
    fn end_context(&self, how: &str) -> Result<CUresult, String> {
        let cu = self.cu;
        // SAFETY: the context this session made; the ABIs follow the lookup.
        Ok(unsafe {
            match how {
                "destroy" => need!(cu.ctx_destroy())(self.context.get()),
                "reset" => need!(cu.primary_ctx_reset())(self.device),
                "release" => need!(cu.primary_ctx_release())(self.device),
                other => return Err(format!("unknown --end-context {other}")),
            }
        })
    }

    /// `churn`: contexts made, given work and ended with the work still queued, round after
    /// round (see the help).
    fn churn(&self) -> Result<(), String> {
        let rounds = self.opts.num_or("rounds", 20)?;
        let launches = self.opts.num_or("launches", 32)?;
        let mut ns: u64 = self.opts.num_or("kernel-us", 1000)? * 1000;
        let how = self.opts.str("context").unwrap_or("primary").to_string();
        let end = self
            .opts
            .str("end-context")
            .unwrap_or(if how == "create" { "destroy" } else { "reset" })
            .to_string();
        let cu = self.cu;
        let launch_kernel = need!(cu.launch_kernel());
        let mut result = 0;
        let mut done = 0;
        'rounds: for round in 0..rounds {
            if round > 0 {
                self.make_context(&how);
            }
            let f = match self.module_function() {
                Ok(f) => f,
                Err(r) => {
                    result = r;
                    break;
                }
            };
            let mut stream: Handle = std::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            let r = unsafe { need!(cu.stream_create())(&mut stream, 0) };
            if r != 0 {
                result = r;
                break;
            }
            let mut params: [*mut c_void; 1] = [&mut ns as *mut u64 as *mut c_void];
            for _ in 0..launches {
                // SAFETY: the ABI of cuda.h 12.9; params outlive the call.
                let r = unsafe {
                    launch_kernel(
                        f,
                        1,
                        1,
                        1,
                        128,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                };
                if r != 0 {
                    result = r;
                    break 'rounds;
                }
            }
            let r = self.end_context(&end)?;
            if r != 0 {
                result = r;
                break;
            }
            done += 1;
        }
        emit(with_result(
            json!({"op": "churn", "rounds": done, "launches": launches}),
            result,
        ));
        Ok(())
    }

    fn devices(&self) -> Result<(), String> {
        let mut count = 0;
        // SAFETY: valid out-pointers throughout.
        unsafe {
            need!(self.cu.device_get_count())(&mut count);
            for i in 0..count {
                let mut dev = 0;
                need!(self.cu.device_get())(&mut dev, i);
                let mut name = [0i8; 128];
                need!(self.cu.device_get_name())(name.as_mut_ptr(), 128, dev);
                let mut uuid = [0u8; 16];
                let ru = need!(self.cu.device_get_uuid())(&mut uuid, dev);
                let total = self.total_mem(dev);
                let attr = |a: i32| {
                    let mut v = 0;
                    need!(self.cu.device_get_attribute())(&mut v, a, dev);
                    v
                };
                emit(json!({
                    "op": "device",
                    "ordinal": i,
                    "name": std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy(),
                    "uuid": (ru == 0).then(|| uuid_string(&uuid)),
                    "total_mem": total["bytes"],
                    "sms": attr(16),
                    "texture_pitch_alignment": attr(51),
                }));
            }
        }
        Ok(())
    }

    fn total_mem(&self, dev: i32) -> Value {
        // SAFETY: the ABI follows the lookup.
        unsafe {
            if self.cu.abi(3020, 3020) {
                let mut b: usize = 0;
                let r = need!(self.cu.device_total_mem_v2())(&mut b, dev);
                with_result(json!({"bytes": b}), r)
            } else {
                let mut b: u32 = 0;
                let r = need!(self.cu.device_total_mem_v1())(&mut b, dev);
                with_result(json!({"bytes": b}), r)
            }
        }
    }

    fn mem_get_info(&self) -> Value {
        // SAFETY: as above.
        unsafe {
            if self.cu.abi(3020, 3020) {
                let (mut f, mut t) = (0usize, 0usize);
                let r = need!(self.cu.mem_get_info_v2())(&mut f, &mut t);
                with_result(json!({"free": f, "total": t}), r)
            } else {
                let (mut f, mut t) = (0u32, 0u32);
                let r = need!(self.cu.mem_get_info_v1())(&mut f, &mut t);
                with_result(json!({"free": f, "total": t}), r)
            }
        }
    }

    fn nvml(&self) -> Option<&Nvml> {
        self.nvml.get_or_init(Nvml::open).as_ref()
    }

    /// Every memory view of the device: the driver's and NVML's (found by the device's UUID, as
    /// a program matches them).
    fn views(&self) -> Value {
        let mut uuid = [0u8; 16];
        // cuDeviceGetUuid arrived with CUDA 9.2: an older --cuda-version has none.
        // SAFETY: valid out-pointer.
        let ru = self
            .cu
            .device_get_uuid()
            .map(|f| unsafe { f(&mut uuid, self.device) });
        let uuid = matches!(ru, Ok(0)).then(|| uuid_string(&uuid));
        let nvml = self.nvml().map(|n| {
            if n.init_result != 0 {
                return json!({"init": n.init_result, "error": nvml_error(n.init_result)});
            }
            let dev = match uuid.as_deref().map(|u| n.device_by_uuid(u)) {
                Some(Ok(d)) => d,
                Some(Err(e)) => return json!({"init": 0, "by_uuid": e, "error": nvml_error(e)}),
                None => return json!({"init": 0, "error": "no CUDA UUID to look the device up by"}),
            };
            let version = self
                .opts
                .num("nvml-v2-version")
                .ok()
                .flatten()
                .map(|v| v as u32)
                .unwrap_or(MEMORY_V2);
            json!({
                "init": 0,
                "v1": n.memory_v1(dev),
                "v2": n.memory_v2(dev, version),
                "processes": n.processes(dev, false)["processes"],
                "processes_v1": n.processes(dev, true)["processes"],
            })
        });
        json!({
            "op": "views",
            "device": self.device,
            "uuid": uuid,
            "cu_mem_get_info": self.mem_get_info(),
            "cu_device_total_mem": self.total_mem(self.device),
            "nvml": nvml,
        })
    }

    fn stream(&self) -> Handle {
        *self
            .stream
            .get_or_init(|| match self.opts.str("stream").unwrap_or("created") {
                "null" => std::ptr::null_mut(),
                "per-thread" => CU_STREAM_PER_THREAD as Handle,
                _ => {
                    let mut s: Handle = std::ptr::null_mut();
                    // SAFETY: valid out-pointer.
                    let r = unsafe { need!(self.cu.stream_create())(&mut s, 0) };
                    if r != 0 {
                        emit(with_result(json!({"op": "stream_create"}), r));
                    }
                    s
                }
            })
    }

    fn pool(&self) -> Handle {
        *self.pool.get_or_init(|| {
            let mut p: Handle = std::ptr::null_mut();
            // SAFETY: valid out-pointers and a zeroed-then-filled props struct.
            let r = unsafe {
                if self.opts.str("pool") == Some("created") {
                    let props = MemPoolProps {
                        alloc_type: 1,
                        handle_types: 0,
                        location: MemLocation {
                            type_: 1,
                            id: self.device,
                        },
                        win32_security_attributes: std::ptr::null_mut(),
                        max_size: 0,
                        usage: 0,
                        reserved: [0; 54],
                    };
                    need!(self.cu.mem_pool_create())(&mut p, &props)
                } else {
                    need!(self.cu.device_get_default_mem_pool())(&mut p, self.device)
                }
            };
            if r != 0 {
                emit(with_result(json!({"op": "pool"}), r));
            }
            p
        })
    }

    fn alloc_prop(&self) -> MemAllocationProp {
        MemAllocationProp {
            type_: 1,
            requested_handle_types: 0,
            location: MemLocation {
                type_: 1,
                id: self.device,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        }
    }

    fn array_desc(&self, size: u64) -> Result<Array3dDescriptor, String> {
        Ok(Array3dDescriptor {
            width: self.opts.num_or("width", size)? as usize,
            height: self.opts.num_or("height", 0)? as usize,
            depth: self.opts.num_or("depth", 0)? as usize,
            format: self.opts.num_or("format", 0x20)? as i32,
            num_channels: self.opts.num_or("channels", 1)? as u32,
            flags: self.opts.num_or("flags", 0)? as u32,
        })
    }

    /// One allocation by `path`; returns its line and what to free.
    fn allocate(
        &self,
        path: &str,
        size: u64,
        index: usize,
    ) -> Result<(Value, Option<Held>), String> {
        let cu = self.cu;
        let mut line = json!({"op": "alloc", "path": path, "index": index, "size": size});
        let v2 = cu.abi(3020, 3020);
        // SAFETY: every call gets valid out-pointers and the ABI its lookup implies.
        let (r, held) = unsafe {
            match path {
                "cuMemAlloc" if v2 => {
                    let mut p: CUdeviceptr = 0;
                    let r = need!(cu.mem_alloc_v2())(&mut p, size as usize);
                    line["ptr"] = json!(format!("{p:#x}"));
                    line["bytes"] = json!(size);
                    (r, Held::Linear { ptr: p, v1: false })
                }
                "cuMemAlloc" => {
                    let mut p: u32 = 0;
                    let r = need!(cu.mem_alloc_v1())(&mut p, size as u32);
                    line["ptr"] = json!(format!("{p:#x}"));
                    line["bytes"] = json!(size);
                    (
                        r,
                        Held::Linear {
                            ptr: p as u64,
                            v1: true,
                        },
                    )
                }
                "cuMemAllocPitch" => {
                    let width = self.opts.num_or("width", size)?;
                    let height = self.opts.num_or("height", 1)?;
                    let element = self.opts.num_or("element", 4)? as u32;
                    let (r, p, pitch) = if v2 {
                        let (mut p, mut pitch) = (0u64, 0usize);
                        let r = need!(cu.mem_alloc_pitch_v2())(
                            &mut p,
                            &mut pitch,
                            width as usize,
                            height as usize,
                            element,
                        );
                        (r, p, pitch as u64)
                    } else {
                        let (mut p, mut pitch) = (0u32, 0u32);
                        let r = need!(cu.mem_alloc_pitch_v1())(
                            &mut p,
                            &mut pitch,
                            width as u32,
                            height as u32,
                            element,
                        );
                        (r, p as u64, pitch as u64)
                    };
                    line["width"] = json!(width);
                    line["height"] = json!(height);
                    line["ptr"] = json!(format!("{p:#x}"));
                    line["pitch"] = json!(pitch);
                    line["bytes"] = json!(pitch * height);
                    (r, Held::Linear { ptr: p, v1: !v2 })
                }
                "cuMemAllocManaged" => {
                    let mut p: CUdeviceptr = 0;
                    let r = need!(cu.mem_alloc_managed())(&mut p, size as usize, 1);
                    line["ptr"] = json!(format!("{p:#x}"));
                    line["bytes"] = json!(size);
                    (r, Held::Linear { ptr: p, v1: false })
                }
                "cuMemCreate" => {
                    let prop = self.alloc_prop();
                    let mut h: u64 = 0;
                    let r = need!(cu.mem_create())(&mut h, size as usize, &prop, 0);
                    line["bytes"] = json!(size);
                    let mut va = None;
                    if r == 0 && self.opts.flag("map") {
                        let mut ptr: CUdeviceptr = 0;
                        let rr = need!(cu.mem_address_reserve())(&mut ptr, size as usize, 0, 0, 0);
                        let rm = if rr == 0 {
                            need!(cu.mem_map())(ptr, size as usize, 0, h, 0)
                        } else {
                            rr
                        };
                        let access = MemAccessDesc {
                            location: MemLocation {
                                type_: 1,
                                id: self.device,
                            },
                            flags: 3,
                        };
                        let ra = if rm == 0 {
                            need!(cu.mem_set_access())(ptr, size as usize, &access, 1)
                        } else {
                            rm
                        };
                        line["map_result"] = json!(ra);
                        line["ptr"] = json!(format!("{ptr:#x}"));
                        if rr == 0 {
                            va = Some((ptr, size as usize, rm == 0));
                        }
                    }
                    // The programming guide's pattern: the handle released at once, the mapping
                    // (and with it the memory) kept until it is unmapped.
                    let released = r == 0 && self.opts.flag("release-after-map");
                    if released {
                        line["release_result"] = json!(need!(cu.mem_release())(h));
                    }
                    (
                        r,
                        Held::Vmm {
                            handle: h,
                            va,
                            released,
                        },
                    )
                }
                "cuMemAllocAsync" | "cuMemAllocFromPoolAsync" => {
                    let stream = self.stream();
                    let mut p: CUdeviceptr = 0;
                    let r = if path == "cuMemAllocAsync" {
                        need!(cu.mem_alloc_async())(&mut p, size as usize, stream)
                    } else {
                        need!(cu.mem_alloc_from_pool_async())(
                            &mut p,
                            size as usize,
                            self.pool(),
                            stream,
                        )
                    };
                    if r == 0 && self.opts.flag("sync") {
                        line["sync_result"] = json!(need!(cu.stream_synchronize())(stream));
                    }
                    line["ptr"] = json!(format!("{p:#x}"));
                    line["bytes"] = json!(size);
                    (r, Held::Async { ptr: p, stream })
                }
                "cuArrayCreate" | "cuArray3DCreate" | "cuMipmappedArrayCreate" => {
                    let d = self.array_desc(size)?;
                    let mut h: Handle = std::ptr::null_mut();
                    let mip = path == "cuMipmappedArrayCreate";
                    let r = match path {
                        "cuArrayCreate" if v2 => {
                            let a = ArrayDescriptor {
                                width: d.width,
                                height: d.height,
                                format: d.format,
                                num_channels: d.num_channels,
                            };
                            need!(cu.array_create_v2())(&mut h, &a)
                        }
                        "cuArrayCreate" => {
                            let a = ArrayDescriptorV1 {
                                width: d.width as u32,
                                height: d.height as u32,
                                format: d.format,
                                num_channels: d.num_channels,
                            };
                            need!(cu.array_create_v1())(&mut h, &a)
                        }
                        "cuArray3DCreate" if v2 => need!(cu.array3d_create_v2())(&mut h, &d),
                        "cuArray3DCreate" => {
                            let a = Array3dDescriptorV1 {
                                width: d.width as u32,
                                height: d.height as u32,
                                depth: d.depth as u32,
                                format: d.format,
                                num_channels: d.num_channels,
                                flags: d.flags,
                            };
                            need!(cu.array3d_create_v1())(&mut h, &a)
                        }
                        _ => need!(cu.mipmapped_array_create())(
                            &mut h,
                            &d,
                            self.opts.num_or("levels", 1)? as u32,
                        ),
                    };
                    line["width"] = json!(d.width);
                    line["height"] = json!(d.height);
                    line["depth"] = json!(d.depth);
                    if r == 0 {
                        let mut req = ArrayMemoryRequirements::default();
                        let getter = if mip {
                            cu.mipmapped_array_get_memory_requirements()
                        } else {
                            cu.array_get_memory_requirements()
                        };
                        if let Ok(g) = getter {
                            let rq = g(&mut req, h, self.device);
                            line["requirements"] = with_result(
                                json!({"size": req.size, "alignment": req.alignment}),
                                rq,
                            );
                            if rq == 0 {
                                line["bytes"] = json!(req.size);
                            }
                        }
                    }
                    (r, Held::Array { handle: h, mip })
                }
                other => return Err(format!("unknown --path {other}")),
            }
        };
        line = with_result(line, r);
        Ok((line, (r == 0).then_some(held)))
    }

    fn release(&self, held: &Held) -> CUresult {
        let cu = self.cu;
        // SAFETY: freeing what allocate() returned, with the matching entry points.
        unsafe {
            match *held {
                Held::Linear { ptr, v1: false } => need!(cu.mem_free_v2())(ptr),
                Held::Linear { ptr, v1: true } => need!(cu.mem_free_v1())(ptr as u32),
                Held::Vmm {
                    handle,
                    va,
                    released,
                } => {
                    let mut unmapped = 0;
                    if let Some((ptr, size, mapped)) = va {
                        if mapped {
                            unmapped = need!(cu.mem_unmap())(ptr, size);
                        }
                        need!(cu.mem_address_free())(ptr, size);
                    }
                    if released {
                        unmapped
                    } else {
                        need!(cu.mem_release())(handle)
                    }
                }
                Held::Async { ptr, stream } => {
                    let r = need!(cu.mem_free_async())(ptr, stream);
                    let s = need!(cu.stream_synchronize())(stream);
                    if r != 0 {
                        r
                    } else {
                        s
                    }
                }
                Held::Array { handle, mip: false } => need!(cu.array_destroy())(handle),
                Held::Array { handle, mip: true } => need!(cu.mipmapped_array_destroy())(handle),
            }
        }
    }

    fn path(&self) -> Result<&str, String> {
        self.opts
            .str("path")
            .ok_or_else(|| "--path is required".to_string())
    }

    fn alloc(&self) -> Result<(), String> {
        let path = self.path()?;
        let sizes = self.opts.nums("size")?.unwrap_or_else(|| vec![1 << 20]);
        let count = self.opts.num_or("count", 1)?;
        let pause = Duration::from_millis(self.opts.num_or("pause-ms", 0)?);
        let mut held = Vec::new();
        let mut index = 0;
        for _ in 0..count {
            for &size in &sizes {
                let (line, h) = self.allocate(path, size, index)?;
                emit(line);
                std::thread::sleep(pause);
                if self.opts.flag("views") {
                    emit(self.views());
                }
                if let Some(h) = h {
                    held.push((index, h));
                }
                index += 1;
            }
        }
        if let Some(how) = self.opts.str("end-context") {
            // Nothing is freed: ending the context frees it. With --hold the process then idles
            // without a context; otherwise a new context (as --context says) shows what is left
            // charged.
            let r = self.end_context(how)?;
            emit(with_result(json!({"op": "end_context", "how": how}), r));
            if self.opts.flag("hold") {
                emit(json!({"op": "hold", "pid": std::process::id()}));
                hold_forever();
            }
            self.make_context(self.opts.str("context").unwrap_or("primary"));
            if self.opts.flag("views") {
                emit(self.views());
            }
            return Ok(());
        }
        if self.opts.flag("hold") {
            emit(json!({"op": "hold", "pid": std::process::id()}));
            hold_forever();
        }
        if !self.opts.flag("no-free") {
            for (index, h) in held {
                let r = self.release(&h);
                emit(with_result(
                    json!({"op": "free", "path": path, "index": index}),
                    r,
                ));
                if self.opts.flag("views") {
                    emit(self.views());
                }
            }
        }
        Ok(())
    }

    fn fill(&self) -> Result<(), String> {
        let path = self.path()?;
        let chunk = self.opts.num("chunk")?.ok_or("--chunk is required")?;
        let limit = self.opts.num_or("limit", 1_000_000)?;
        let mut held = Vec::new();
        let mut allocated: u64 = 0;
        let mut last = 0;
        while (held.len() as u64) < limit {
            let (line, h) = self.allocate(path, chunk, held.len())?;
            last = line["result"].as_i64().unwrap_or(-1) as CUresult;
            match h {
                Some(h) => {
                    allocated += line["bytes"].as_u64().unwrap_or(chunk);
                    held.push(h);
                }
                None => break,
            }
        }
        emit(with_result(
            json!({"op": "fill", "path": path, "chunk": chunk, "count": held.len(), "allocated": allocated}),
            last,
        ));
        if self.opts.flag("views") {
            emit(self.views());
        }
        if self.opts.flag("hold") {
            emit(json!({"op": "hold", "pid": std::process::id()}));
            hold_forever();
        }
        for h in &held {
            self.release(h);
        }
        Ok(())
    }

    fn free(&self) -> Result<(), String> {
        let ptr = self.opts.num("ptr")?.ok_or("--ptr is required")?;
        let r = self.release(&Held::Linear {
            ptr,
            v1: !self.cu.abi(3020, 3020),
        });
        emit(with_result(
            json!({"op": "free", "ptr": format!("{ptr:#x}")}),
            r,
        ));
        Ok(())
    }

    fn hold(&self) -> Result<(), String> {
        let path = self.path()?;
        let size = self.opts.num("size")?.ok_or("--size is required")?;
        let (mut line, _h) = self.allocate(path, size, 0)?;
        line["op"] = json!("hold");
        line["pid"] = json!(std::process::id());
        emit(line);
        hold_forever();
    }

    fn getproc(&self) -> Result<(), String> {
        let symbol = self.opts.str("symbol").ok_or("--symbol is required")?;
        let flags = match self.opts.num("flags")? {
            Some(f) => f,
            None => self.cu.loader.proc_flags(),
        };
        let version = self.cu.loader.version;
        let version = if matches!(
            self.cu.loader.lookup,
            crate::loader::Lookup::Proc | crate::loader::Lookup::ProcV1
        ) {
            version
        } else {
            self.opts.num_or("cuda-version", version as u64)? as i32
        };
        let (r, status, addr) = self
            .cu
            .loader
            .get_proc(symbol, version, flags)
            .ok_or("libcuda.so.1 has no cuGetProcAddress_v2")?;
        let mut candidates: Vec<String> = [
            "", "_v2", "_v3", "_v4", "_ptsz", "_ptds", "_v2_ptsz", "_v2_ptds", "_v3_ptsz",
        ]
        .iter()
        .map(|s| format!("{symbol}{s}"))
        .collect();
        if let Some(extra) = self.opts.str("candidates") {
            candidates.extend(extra.split(',').map(String::from));
        }
        if symbol == "cuGraphInstantiate" {
            candidates.push("cuGraphInstantiateWithFlags".into());
        }
        let matches: Vec<&String> = candidates
            .iter()
            .filter(|c| !addr.is_null() && self.cu.loader.dlsym_handle(c) == addr)
            .collect();
        let (object, object_symbol) = where_is(addr);
        emit(with_result(
            json!({
                "op": "getproc",
                "symbol": symbol,
                "version": version,
                "flags": flags,
                "status": status,
                "address": format!("{:#x}", addr as usize),
                "matches": matches,
                "object": object,
                "object_symbol": object_symbol,
            }),
            r,
        ));
        Ok(())
    }

    /// The views a process can take: the driver's when it initialised CUDA, NVML's by index
    /// otherwise (a process that never touched CUDA).
    fn any_views(&self) -> Value {
        if self.opts.flag("no-init") {
            match self.nvml() {
                Some(n) if n.init_result == 0 => crate::nvml_only::views_of(n, 0, MEMORY_V2),
                _ => json!({"op": "nvml_views", "error": "no NVML"}),
            }
        } else {
            self.views()
        }
    }

    /// `fork`: the parent (set up as the options say, with an allocation by --path and --size if
    /// given) takes its views and forks. The child (its lines carry "who": "child") sets CUDA up
    /// again, allocates --child-size by --child-path, takes its views (the driver's and NVML's)
    /// and exits, or with --child-hold prints a hold line and sleeps until killed. The parent
    /// waits for it, says how it ended, and takes its views again.
    fn fork(&self) -> Result<(), String> {
        let mut held = None;
        if let Some(size) = self.opts.num("size")? {
            let (line, h) = self.allocate(self.path()?, size, 0)?;
            emit(line);
            held = h;
        }
        emit(self.any_views());
        // SAFETY: fork(2); the child runs on in this single Rust thread and ends with exit(2).
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(format!("fork: {}", std::io::Error::last_os_error()));
        }
        if pid == 0 {
            self.forked_child();
        }
        emit(json!({"op": "forked", "child": pid}));
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        emit(json!({
            "op": "child_exit",
            "code": libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
            "signal": libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
        }));
        std::thread::sleep(Duration::from_millis(self.opts.num_or("after-ms", 0)?));
        emit(self.any_views());
        if let Some(h) = held {
            emit(with_result(
                json!({"op": "free", "index": 0}),
                self.release(&h),
            ));
        }
        Ok(())
    }

    fn forked_child(&self) -> ! {
        FORKED_CHILD.store(true, std::sync::atomic::Ordering::Relaxed);
        emit(json!({"op": "child", "pid": std::process::id()}));
        // What the driver says to a forked child (a real driver refuses one whose parent
        // initialised it), with a context as --child-context says (default primary).
        self.init_and_context(true, self.opts.str("child-context").unwrap_or("primary"));
        let code = match self.opts.num("child-size") {
            Ok(Some(size)) => {
                let path = self.opts.str("child-path").unwrap_or("cuMemAlloc");
                match self.allocate(path, size, 0) {
                    Ok((line, _)) => {
                        emit(line);
                        0
                    }
                    Err(e) => usage(e),
                }
            }
            Ok(None) => 0,
            Err(e) => usage(e),
        };
        emit(self.views());
        if let Some(n) = self.nvml().filter(|n| n.init_result == 0) {
            emit(crate::nvml_only::views_of(n, 0, MEMORY_V2));
        }
        if self.opts.flag("child-hold") {
            emit(json!({"op": "hold", "pid": std::process::id()}));
            hold_forever();
        }
        // exit(3), not _exit: the child's atexit handlers run, as a program's would.
        std::process::exit(code);
    }

    /// `fork-storm`: forks again and again while another thread makes the process's first CUDA
    /// calls (the library's start-up: its shared files opened); each child counts the descriptors
    /// it inherited that name a file whose path contains --marker, and exits with that count.
    fn fork_storm(&self) -> Result<(), String> {
        let forks = self.opts.num_or("forks", 300)?;
        let marker = self
            .opts
            .str("marker")
            .ok_or("--marker is required")?
            .as_bytes()
            .to_vec();
        let init = need!(self.cu.init());
        let retain = need!(self.cu.primary_ctx_retain());
        let device = self.device;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let starting = {
            let done = done.clone();
            std::thread::spawn(move || {
                let mut ctx: Handle = std::ptr::null_mut();
                // SAFETY: cuInit(0) and a valid out-pointer.
                unsafe {
                    init(0);
                    retain(&mut ctx, device);
                }
                done.store(true, std::sync::atomic::Ordering::Release);
            })
        };
        let (mut during, mut with_files, mut made) = (0u64, 0u64, 0u64);
        for _ in 0..forks {
            let starting_now = !done.load(std::sync::atomic::Ordering::Acquire);
            // SAFETY: fork(2); the child makes async-signal-safe calls only (readlink, _exit).
            let pid = unsafe { libc::fork() };
            if pid < 0 {
                return Err(format!("fork: {}", std::io::Error::last_os_error()));
            }
            if pid == 0 {
                let mut count = 0;
                let mut link = [0u8; 64];
                let mut target = [0u8; 4096];
                for fd in 3..1024 {
                    let mut w = std::io::Cursor::new(&mut link[..]);
                    if write!(w, "/proc/self/fd/{fd}\0").is_err() {
                        continue;
                    }
                    // SAFETY: a NUL-terminated path and a buffer we own.
                    let n = unsafe {
                        libc::readlink(
                            link.as_ptr().cast(),
                            target.as_mut_ptr().cast(),
                            target.len(),
                        )
                    };
                    if n > 0
                        && target[..n as usize]
                            .windows(marker.len())
                            .any(|w| w == marker)
                    {
                        count += 1;
                    }
                }
                // SAFETY: ends the child without running the parent's handlers.
                unsafe { libc::_exit(count.min(100)) };
            }
            made += 1;
            during += starting_now as u64;
            let mut status = 0;
            // SAFETY: waits for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) > 0 {
                with_files += 1;
            }
        }
        let _ = starting.join();
        emit(json!({
            "op": "fork_storm",
            "forks": made,
            "during_start_up": during,
            "children_with_parent_files": with_files,
        }));
        Ok(())
    }

    /// `dlsym --symbol NAME [--library cuda|nvml]`: `dlsym` on the library's handle, as a program
    /// resolving one entry point does, and where the address lies (`dladdr`).
    fn dlsym(&self) -> Result<(), String> {
        let symbol = self.opts.str("symbol").ok_or("--symbol is required")?;
        let library = self.opts.str("library").unwrap_or("cuda");
        let handle = match library {
            "cuda" => self.cu.loader.handle,
            "nvml" => crate::loader::open_nvml().ok_or("libnvidia-ml.so.1 is not there")?,
            other => return Err(format!("unknown --library {other}")),
        };
        // SAFETY: clears a pending error so that the one read below is dlsym's.
        unsafe { libc::dlerror() };
        let addr = crate::loader::dlsym(handle, symbol);
        let error = addr.is_null().then(crate::loader::dlerror_text);
        let (object, object_symbol) = where_is(addr);
        emit(json!({
            "op": "dlsym",
            "library": library,
            "symbol": symbol,
            "address": format!("{:#x}", addr as usize),
            "object": object,
            "object_symbol": object_symbol,
            "error": error,
        }));
        Ok(())
    }

    fn module_function(&self) -> Result<Handle, CUresult> {
        let ptx = CString::new(PTX).expect("PTX has no NUL");
        let mut m: Handle = std::ptr::null_mut();
        let mut f: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the image is NUL-terminated PTX.
        unsafe {
            let r = need!(self.cu.module_load_data())(&mut m, ptx.as_ptr() as *const c_void);
            if r != 0 {
                return Err(r);
            }
            let r = need!(self.cu.module_get_function())(&mut f, m, c"gpupool_spin".as_ptr());
            if r != 0 {
                return Err(r);
            }
        }
        Ok(f)
    }

    /// A graph of `nodes` kernels of `ns` each: explicit kernel nodes, or captured from a stream.
    fn graph(
        &self,
        f: Handle,
        ns: &mut u64,
        nodes: u64,
        grid: u32,
        block: u32,
        capture: bool,
    ) -> Result<Handle, CUresult> {
        let cu = self.cu;
        let mut params: [*mut c_void; 1] = [ns as *mut u64 as *mut c_void];
        let mut graph: Handle = std::ptr::null_mut();
        // SAFETY: the ABIs follow the lookup; params outlive the calls (the driver copies them).
        unsafe {
            if capture {
                let stream = self.stream();
                // Work already queued when the capture begins (a library's events on it may still
                // be pending), then a capture that takes a while, as a program building a large
                // graph does.
                let pre = self.opts.num_or("pre-launches", 0).unwrap_or(0);
                for _ in 0..pre {
                    let r = need!(cu.launch_kernel())(
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
                    );
                    if r != 0 {
                        return Err(r);
                    }
                }
                let r = if cu.abi(10010, 10010) {
                    need!(cu.stream_begin_capture_v2())(stream, 0)
                } else {
                    need!(cu.stream_begin_capture_v1())(stream)
                };
                if r != 0 {
                    return Err(r);
                }
                for _ in 0..nodes {
                    let r = need!(cu.launch_kernel())(
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
                    );
                    if r != 0 {
                        return Err(r);
                    }
                }
                let hold = self.opts.num_or("capture-hold-ms", 0).unwrap_or(0);
                std::thread::sleep(Duration::from_millis(hold));
                let r = need!(cu.stream_end_capture())(stream, &mut graph);
                if r != 0 {
                    return Err(r);
                }
            } else {
                let r = need!(cu.graph_create())(&mut graph, 0);
                if r != 0 {
                    return Err(r);
                }
                let mut prev: Option<Handle> = None;
                for _ in 0..nodes {
                    let p1 = KernelNodeParams {
                        func: f,
                        grid: [grid, 1, 1],
                        block: [block, 1, 1],
                        shared_mem_bytes: 0,
                        kernel_params: params.as_mut_ptr(),
                        extra: std::ptr::null_mut(),
                    };
                    let mut node: Handle = std::ptr::null_mut();
                    let deps = prev
                        .as_ref()
                        .map_or(std::ptr::null(), |p| p as *const Handle);
                    let ndeps = prev.is_some() as usize;
                    let r = if cu.abi(12000, 12000) {
                        let p2 = KernelNodeParamsV2 {
                            v1: p1,
                            kern: std::ptr::null_mut(),
                            ctx: std::ptr::null_mut(),
                        };
                        need!(cu.graph_add_kernel_node_v2())(&mut node, graph, deps, ndeps, &p2)
                    } else {
                        need!(cu.graph_add_kernel_node_v1())(&mut node, graph, deps, ndeps, &p1)
                    };
                    if r != 0 {
                        return Err(r);
                    }
                    prev = Some(node);
                }
            }
            let mut exec: Handle = std::ptr::null_mut();
            let r = if cu.abi(12000, 12000) {
                need!(cu.graph_instantiate_with_flags())(&mut exec, graph, 0)
            } else {
                need!(cu.graph_instantiate_v1())(
                    &mut exec,
                    graph,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                )
            };
            if r != 0 {
                return Err(r);
            }
            need!(cu.graph_destroy())(graph);
            Ok(exec)
        }
    }

    fn bench_launch(&self) -> Result<(), String> {
        let count = self.opts.num_or("count", 10000)?;
        let mode = self.opts.str("mode").unwrap_or("eager");
        let f = self
            .module_function()
            .map_err(|r| format!("module: {}", error_name(r)))?;
        let stream = self.stream();
        let mut ns: u64 = 0;
        let exec = if mode == "graph" {
            Some(
                self.graph(f, &mut ns, 1, 1, 32, false)
                    .map_err(|r| format!("graph: {}", error_name(r)))?,
            )
        } else {
            None
        };
        let launch_kernel = need!(self.cu.launch_kernel());
        let graph_launch = need!(self.cu.graph_launch());
        let sync = need!(self.cu.stream_synchronize());
        let mut params: [*mut c_void; 1] = [&mut ns as *mut u64 as *mut c_void];
        let mut times = Vec::with_capacity(count as usize);
        for i in 0..count + 64 {
            let t = Instant::now();
            // SAFETY: cuda.h 12.9's ABIs; params outlive the call.
            let r = unsafe {
                match exec {
                    Some(e) => graph_launch(e, stream),
                    None => launch_kernel(
                        f,
                        1,
                        1,
                        1,
                        32,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    ),
                }
            };
            let dt = t.elapsed().as_nanos() as u64;
            if r != 0 {
                emit(with_result(
                    json!({"op": "bench_launch", "mode": mode, "failed_at": i}),
                    r,
                ));
                return Ok(());
            }
            if i >= 64 {
                times.push(dt);
            }
            if i % 256 == 255 {
                // SAFETY: the stream in use.
                unsafe { sync(stream) };
            }
        }
        // SAFETY: as above.
        unsafe { sync(stream) };
        let (mean, median, p99) = stats(&mut times);
        emit(
            json!({"op": "bench_launch", "mode": mode, "count": count, "ns_per_launch_mean": mean, "ns_per_launch_median": median, "ns_p99": p99}),
        );
        Ok(())
    }

    fn bench_alloc(&self) -> Result<(), String> {
        let count = self.opts.num_or("count", 10000)?;
        let size = self.opts.num_or("size", 1 << 20)?;
        let path = self.opts.str("path").unwrap_or("cuMemAlloc");
        let (mut ta, mut tf) = (Vec::new(), Vec::new());
        for i in 0..count + 16 {
            let t = Instant::now();
            let (line, h) = self.allocate(path, size, i as usize)?;
            let a = t.elapsed().as_nanos() as u64;
            let Some(h) = h else {
                emit(with_result(
                    json!({"op": "bench_alloc", "path": path, "failed_at": i}),
                    line["result"].as_i64().unwrap_or(-1) as i32,
                ));
                return Ok(());
            };
            let t = Instant::now();
            // cuMemFreeAsync is timed without the synchronisation release() adds.
            let r = match h {
                // SAFETY: what allocate() returned.
                Held::Async { ptr, stream } => unsafe {
                    need!(self.cu.mem_free_async())(ptr, stream)
                },
                _ => self.release(&h),
            };
            let f = t.elapsed().as_nanos() as u64;
            if r != 0 {
                emit(with_result(
                    json!({"op": "bench_alloc", "path": path, "failed_free_at": i}),
                    r,
                ));
                return Ok(());
            }
            if i >= 16 {
                ta.push(a);
                tf.push(f);
            }
        }
        let (am, amed, _) = stats(&mut ta);
        let (fm, fmed, _) = stats(&mut tf);
        emit(
            json!({"op": "bench_alloc", "path": path, "count": count, "size": size, "ns_alloc_mean": am, "ns_alloc_median": amed, "ns_free_mean": fm, "ns_free_median": fmed}),
        );
        Ok(())
    }
}

fn stats(v: &mut [u64]) -> (f64, u64, u64) {
    if v.is_empty() {
        return (0.0, 0, 0);
    }
    v.sort_unstable();
    let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
    (
        mean,
        v[v.len() / 2],
        v[(v.len() * 99 / 100).min(v.len() - 1)],
    )
}

/// The file name of the object an address lies in, and the symbol `dladdr` names for it.
fn where_is(addr: *mut c_void) -> (Option<String>, Option<String>) {
    if addr.is_null() {
        return (None, None);
    }
    // SAFETY: dladdr fills a Dl_info we own; its strings belong to the loader.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(addr, &mut info) == 0 {
            return (None, None);
        }
        let text = |p: *const std::ffi::c_char| {
            (!p.is_null()).then(|| {
                let full = std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
                full.rsplit('/').next().unwrap_or(&full).to_string()
            })
        };
        (text(info.dli_fname), text(info.dli_sname))
    }
}

fn hold_forever() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// What an allocation left to free.
enum Held {
    Linear {
        ptr: CUdeviceptr,
        v1: bool,
    },
    Vmm {
        handle: u64,
        va: Option<(CUdeviceptr, usize, bool)>,
        /// Released right after mapping (`--release-after-map`): unmapping frees it.
        released: bool,
    },
    Async {
        ptr: CUdeviceptr,
        stream: Handle,
    },
    Array {
        handle: Handle,
        mip: bool,
    },
}

// After `need!`, which they use.
#[path = "capture_rules.rs"]
mod capture_rules;
#[path = "launch.rs"]
mod launch;
