/* driver_check: the CUDA driver API parts of gpu-check, as JSON lines on stdout.
 *
 * It needs no CUDA header and no toolkit: it declares the few types it uses (after cuda.h 12.x)
 * and reaches libcuda.so.1 and libnvidia-ml.so.1 by dlopen, finding every driver entry point
 * through cuGetProcAddress_v2 (version 12000, default stream), the way the CUDA runtime does. So
 * it builds with any C compiler (`cc -O2 -o driver_check driver_check.c -ldl`) and runs over the
 * real driver on a GPU or over gpupool's stand-in driver in CI.
 *
 *   driver_check paths [--path P] [--chunk-mib N]
 *       each allocation path filled to the limit and beyond: chunks until one is refused, then
 *       (linear paths) exactly what cuMemGetInfo says is free, then one byte (or granule) more;
 *       the views (cuMemGetInfo, cuDeviceTotalMem, NVML v1 and v2) before, at the limit and after
 *       everything is freed.
 *   driver_check launch [--count N]
 *       N launches of an empty kernel, each call timed: {"op":"launch","median_ns",...}
 *   driver_check share --mode eager|cooperative (--iters N | --calibrate-ms M) --slot K
 *                      --warmup-ms W --seconds S
 *       a fixed amount of work per launch (a loop of N dependent multiply-adds per thread over the
 *       whole card), launched back to back with at most 4 launches in flight, through
 *       cuLaunchKernel or cuLaunchCooperativeKernel. It prints {"op":"ready"}, reads a start time
 *       (CLOCK_MONOTONIC, seconds) on stdin, warms up W ms from start + K x (W + S), and counts
 *       the launches of the S seconds after: {"op":"share","per_second",...}. Work, not time: a
 *       kernel that spins on a clock finishes on time whatever share of the card it gets.
 *   driver_check nvml
 *       whether NVML's per-process queries answer for this process (a context and 64 MiB held),
 *       asked while its kernels run.
 *   driver_check procaddr
 *       whether cuGetProcAddress returns the driver's exported symbols (dlsym's addresses).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUmodule, *CUfunction, *CUarray, *CUmemoryPool;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct { int type, id; } CUmemLocation;
typedef struct {
    int type, requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} CUmemAllocationProp;
typedef struct {
    int allocType, handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;
typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct {
    size_t Width, Height, Depth;
    int Format;
    unsigned NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

#define CU_AD_FORMAT_FLOAT 0x20
#define CU_MEM_ATTACH_GLOBAL 1
#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
typedef struct { unsigned pid; unsigned long long timeStamp; unsigned smUtil, memUtil, encUtil, decUtil; } nvmlProcessUtilizationSample_t;

static void *cuda, *nvml;
typedef CUresult (*getproc_t)(const char *, void **, int, unsigned long long, int *);
static getproc_t getproc;

/* The entry point `base` as the runtime finds it (NULL, with a line, if the driver has none). */
static void *entry(const char *base) {
    void *f = NULL;
    int status = -1;
    CUresult r = getproc(base, &f, 12000, 0, &status);
    if (r != CUDA_SUCCESS || f == NULL)
        printf("{\"op\":\"missing\",\"symbol\":\"%s\",\"result\":%d,\"status\":%d}\n", base, r, status);
    return f;
}

#define CU(name, ...) ((CUresult (*)(__VA_ARGS__))entry(#name))
#define NV(name, ...) ((nvmlReturn_t (*)(__VA_ARGS__))(nvml ? dlsym(nvml, #name) : NULL))

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static CUdevice device;
static char uuid_text[64];

static int setup(void) {
    cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) {
        printf("{\"op\":\"error\",\"message\":\"dlopen libcuda.so.1: %s\"}\n", dlerror());
        return 0;
    }
    getproc = (getproc_t)dlsym(cuda, "cuGetProcAddress_v2");
    if (!getproc) {
        printf("{\"op\":\"error\",\"message\":\"no cuGetProcAddress_v2\"}\n");
        return 0;
    }
    CUresult r = CU(cuInit, unsigned)(0);
    CUcontext ctx = NULL;
    if (r == CUDA_SUCCESS) r = CU(cuDeviceGet, CUdevice *, int)(&device, 0);
    if (r == CUDA_SUCCESS) r = CU(cuDevicePrimaryCtxRetain, CUcontext *, CUdevice)(&ctx, device);
    if (r == CUDA_SUCCESS) r = CU(cuCtxSetCurrent, CUcontext)(ctx);
    unsigned char u[16] = {0};
    if (r == CUDA_SUCCESS) r = CU(cuDeviceGetUuid, unsigned char *, CUdevice)(u, device);
    snprintf(uuid_text, sizeof uuid_text,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
             u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    printf("{\"op\":\"setup\",\"result\":%d,\"uuid\":\"%s\",\"pid\":%d}\n", r, uuid_text, getpid());
    nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (nvml && NV(nvmlInit_v2, void)() != 0) nvml = NULL;
    return r == CUDA_SUCCESS;
}

static nvmlDevice_t nvml_device(void) {
    nvmlDevice_t d = NULL;
    if (!nvml || NV(nvmlDeviceGetHandleByUUID, const char *, nvmlDevice_t *)(uuid_text, &d) != 0)
        return NULL;
    return d;
}

/* Every memory view of the device, as one JSON line. */
static void views(const char *when) {
    size_t free = 0, total = 0, device_total = 0;
    CUresult r1 = CU(cuMemGetInfo, size_t *, size_t *)(&free, &total);
    CUresult r2 = CU(cuDeviceTotalMem, size_t *, CUdevice)(&device_total, device);
    printf("{\"op\":\"views\",\"when\":\"%s\",\"cu_mem_get_info\":{\"result\":%d,\"free\":%zu,"
           "\"total\":%zu},\"cu_device_total_mem\":{\"result\":%d,\"bytes\":%zu}",
           when, r1, free, total, r2, device_total);
    nvmlDevice_t d = nvml_device();
    if (d) {
        nvmlMemory_t m1 = {0};
        nvmlMemory_v2_t m2 = {0};
        m2.version = (unsigned)sizeof(nvmlMemory_v2_t) | (2u << 24);
        nvmlReturn_t n1 = NV(nvmlDeviceGetMemoryInfo, nvmlDevice_t, nvmlMemory_t *)(d, &m1);
        nvmlReturn_t n2 = NV(nvmlDeviceGetMemoryInfo_v2, nvmlDevice_t, nvmlMemory_v2_t *)(d, &m2);
        printf(",\"nvml_v1\":{\"result\":%d,\"total\":%llu,\"free\":%llu,\"used\":%llu},"
               "\"nvml_v2\":{\"result\":%d,\"total\":%llu,\"reserved\":%llu,\"free\":%llu,\"used\":%llu}",
               n1, m1.total, m1.free, m1.used, n2, m2.total, m2.reserved, m2.free, m2.used);
    }
    printf("}\n");
    fflush(stdout);
}

static size_t cu_free_bytes(void) {
    size_t free = 0, total = 0;
    CU(cuMemGetInfo, size_t *, size_t *)(&free, &total);
    return free;
}

/* One allocation path: allocate `bytes` (rounded as the path needs) and free it. */
typedef struct {
    const char *name;
    int linear; /* takes any size: the exact remainder is tried */
} path_t;

static CUstream stream;
static CUmemoryPool pool;
static size_t granularity = 2 << 20;

typedef struct { int kind; CUdeviceptr ptr; CUmemGenericAllocationHandle handle; CUarray array; } held_t;

static CUresult allocate(const char *path, size_t bytes, held_t *h) {
    memset(h, 0, sizeof *h);
    if (!strcmp(path, "cuMemAlloc")) {
        h->kind = 1;
        return CU(cuMemAlloc, CUdeviceptr *, size_t)(&h->ptr, bytes);
    }
    if (!strcmp(path, "cuMemAllocManaged")) {
        h->kind = 1;
        return CU(cuMemAllocManaged, CUdeviceptr *, size_t, unsigned)(&h->ptr, bytes, CU_MEM_ATTACH_GLOBAL);
    }
    if (!strcmp(path, "cuMemAllocPitch")) {
        /* 4096-byte rows: the pitch equals the width on every card we know of. */
        size_t pitch = 0, height = bytes / 4096 ? bytes / 4096 : 1;
        h->kind = 1;
        return CU(cuMemAllocPitch, CUdeviceptr *, size_t *, size_t, size_t, unsigned)(&h->ptr, &pitch, 4096, height, 4);
    }
    if (!strcmp(path, "cuMemAllocAsync")) {
        h->kind = 2;
        return CU(cuMemAllocAsync, CUdeviceptr *, size_t, CUstream)(&h->ptr, bytes, stream);
    }
    if (!strcmp(path, "cuMemAllocFromPoolAsync")) {
        h->kind = 2;
        return CU(cuMemAllocFromPoolAsync, CUdeviceptr *, size_t, CUmemoryPool, CUstream)(&h->ptr, bytes, pool, stream);
    }
    if (!strcmp(path, "cuMemCreate")) {
        CUmemAllocationProp prop = {0};
        prop.type = 1;
        prop.location.type = 1;
        prop.location.id = device;
        h->kind = 3;
        return CU(cuMemCreate, CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)(
            &h->handle, bytes, &prop, 0);
    }
    if (!strcmp(path, "cuArrayCreate")) {
        /* Floats, 4096 wide: 16 KiB rows. */
        CUDA_ARRAY_DESCRIPTOR d = {4096, bytes / 16384 ? bytes / 16384 : 1, CU_AD_FORMAT_FLOAT, 1};
        h->kind = 4;
        return CU(cuArrayCreate, CUarray *, const CUDA_ARRAY_DESCRIPTOR *)(&h->array, &d);
    }
    if (!strcmp(path, "cuArray3DCreate")) {
        CUDA_ARRAY3D_DESCRIPTOR d = {4096, 1024, bytes / (16384 * 1024) ? bytes / (16384 * 1024) : 1, CU_AD_FORMAT_FLOAT, 1, 0};
        h->kind = 4;
        return CU(cuArray3DCreate, CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *)(&h->array, &d);
    }
    if (!strcmp(path, "cuMipmappedArrayCreate")) {
        CUDA_ARRAY3D_DESCRIPTOR d = {4096, bytes / 16384 ? bytes / 16384 : 1, 0, CU_AD_FORMAT_FLOAT, 1, 0};
        h->kind = 5;
        return CU(cuMipmappedArrayCreate, CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned)(&h->array, &d, 1);
    }
    return -1;
}

static CUresult release(held_t *h) {
    switch (h->kind) {
    case 1: return CU(cuMemFree, CUdeviceptr)(h->ptr);
    case 2: {
        CUresult r = CU(cuMemFreeAsync, CUdeviceptr, CUstream)(h->ptr, stream);
        CU(cuStreamSynchronize, CUstream)(stream);
        return r;
    }
    case 3: return CU(cuMemRelease, CUmemGenericAllocationHandle)(h->handle);
    case 4: return CU(cuArrayDestroy, CUarray)(h->array);
    case 5: return CU(cuMipmappedArrayDestroy, CUarray)(h->array);
    }
    return -1;
}

#define MAX_HELD 4096

static void fill(const char *path, int linear, size_t chunk) {
    static held_t held[MAX_HELD];
    int n = 0;
    CUresult last = CUDA_SUCCESS;
    views("before");
    while (n < MAX_HELD - 2) {
        last = allocate(path, chunk, &held[n]);
        if (last != CUDA_SUCCESS) break;
        n++;
    }
    int chunks = n;
    size_t left = cu_free_bytes();
    int exact = -1, beyond = -1;
    size_t exact_bytes = 0;
    if (last == CUDA_ERROR_OUT_OF_MEMORY && linear && left > 0) {
        /* Exactly what is left fits; one byte more (one granule for cuMemCreate) does not. */
        exact_bytes = !strcmp(path, "cuMemCreate") ? left / granularity * granularity : left;
        if (exact_bytes > 0) {
            exact = allocate(path, exact_bytes, &held[n]);
            if (exact == CUDA_SUCCESS) n++;
            beyond = allocate(path, !strcmp(path, "cuMemCreate") ? granularity : 1, &held[n]);
            if (beyond == CUDA_SUCCESS) n++;
        }
    }
    printf("{\"op\":\"fill\",\"path\":\"%s\",\"chunk\":%zu,\"chunks\":%d,\"refused\":%d,"
           "\"left\":%zu,\"exact_bytes\":%zu,\"exact\":%d,\"beyond\":%d}\n",
           path, chunk, chunks, last, left, exact_bytes, exact, beyond);
    views("at_limit");
    int failed_frees = 0;
    for (int i = 0; i < n; i++) failed_frees += release(&held[i]) != CUDA_SUCCESS;
    printf("{\"op\":\"freed\",\"path\":\"%s\",\"count\":%d,\"failed\":%d}\n", path, n, failed_frees);
    views("after");
}

static const path_t PATHS[] = {
    {"cuMemAlloc", 1},        {"cuMemAllocManaged", 1}, {"cuMemAllocAsync", 1},
    {"cuMemAllocFromPoolAsync", 1}, {"cuMemCreate", 1},   {"cuMemAllocPitch", 0},
    {"cuArrayCreate", 0},     {"cuArray3DCreate", 0},   {"cuMipmappedArrayCreate", 0},
};

static int paths(const char *only, size_t chunk) {
    CU(cuStreamCreate, CUstream *, unsigned)(&stream, 0);
    CUmemPoolProps props = {0};
    props.allocType = 1;
    props.location.type = 1;
    props.location.id = device;
    CU(cuMemPoolCreate, CUmemoryPool *, const CUmemPoolProps *)(&pool, &props);
    CUmemAllocationProp prop = {0};
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = device;
    CU(cuMemGetAllocationGranularity, size_t *, const CUmemAllocationProp *, int)(&granularity, &prop, 0);
    for (size_t i = 0; i < sizeof PATHS / sizeof PATHS[0]; i++)
        if (!only || !strcmp(only, PATHS[i].name)) fill(PATHS[i].name, PATHS[i].linear, chunk);
    return 0;
}

/* A kernel that spins for its parameter in nanoseconds (0: returns at once). */
static const char PTX[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n"
    ".visible .entry gpupool_spin(.param .u64 gpupool_spin_param_0)\n{\n"
    "\t.reg .pred %p<2>;\n\t.reg .b64 %rd<5>;\n"
    "\tld.param.u64 %rd1, [gpupool_spin_param_0];\n\tmov.u64 %rd2, %globaltimer;\n"
    "$L__BB0_1:\n\tmov.u64 %rd3, %globaltimer;\n\tsub.s64 %rd4, %rd3, %rd2;\n"
    "\tsetp.lt.u64 %p1, %rd4, %rd1;\n\t@%p1 bra $L__BB0_1;\n\tret;\n}\n";

/* Work for the share checks: `iters` dependent multiply-adds per thread; the result is stored
 * only if it is impossible, which the compiler cannot know, so the loop stays. (A stand-in
 * driver reads the first parameter as nanoseconds of work.) */
static const char WORK_PTX[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n"
    ".visible .entry gpupool_work(.param .u64 gpupool_work_iters, .param .u64 gpupool_work_out)\n{\n"
    "\t.reg .pred %p<3>;\n\t.reg .b64 %rd<5>;\n\t.reg .f32 %f<3>;\n"
    "\tld.param.u64 %rd1, [gpupool_work_iters];\n\tld.param.u64 %rd4, [gpupool_work_out];\n"
    "\tmov.u64 %rd2, 0;\n\tmov.f32 %f1, 0f3F800000;\n"
    "$L__WORK:\n\tfma.rn.f32 %f1, %f1, 0f3F7FFFFF, 0f33D6BF95;\n\tadd.u64 %rd2, %rd2, 1;\n"
    "\tsetp.lt.u64 %p1, %rd2, %rd1;\n\t@%p1 bra $L__WORK;\n"
    "\tsetp.eq.f32 %p2, %f1, 0f461C3C00;\n\t@!%p2 bra $L__DONE;\n"
    "\tst.global.f32 [%rd4], %f1;\n$L__DONE:\n\tret;\n}\n";

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* `count` launches of the kernel spinning `ns` each; with `report`, one line of per-call times. */
static int launch(long count, unsigned long long ns, int report) {
    CUmodule module;
    CUfunction f;
    CUresult r = CU(cuModuleLoadData, CUmodule *, const void *)(&module, PTX);
    if (r == CUDA_SUCCESS) r = CU(cuModuleGetFunction, CUfunction *, CUmodule, const char *)(&f, module, "gpupool_spin");
    if (r != CUDA_SUCCESS) {
        printf("{\"op\":\"launch\",\"result\":%d}\n", r);
        return 1;
    }
    CU(cuStreamCreate, CUstream *, unsigned)(&stream, 0);
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **) =
        (CUresult(*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **, void **))entry("cuLaunchKernel");
    CUresult (*sync)(CUstream) = (CUresult(*)(CUstream))entry("cuStreamSynchronize");
    void *params[] = {&ns};
    double *times = malloc(sizeof(double) * count);
    double start = now_ns();
    for (long i = 0; i < count; i++) {
        double t = now_ns();
        r = launch_kernel(f, 1, 1, 1, 32, 1, 1, 0, stream, params, NULL);
        times[i] = now_ns() - t;
        if (r != CUDA_SUCCESS) break;
        if (i % 256 == 255) sync(stream);
    }
    sync(stream);
    double total = now_ns() - start;
    qsort(times, count, sizeof(double), cmp_double);
    if (report)
        printf("{\"op\":\"launch\",\"result\":%d,\"count\":%ld,\"median_ns\":%.0f,\"p99_ns\":%.0f,"
           "\"per_launch_ns\":%.0f}\n",
           r, count, times[count / 2], times[count * 99 / 100], total / count);
    free(times);
    return r != CUDA_SUCCESS;
}

static double monotonic_s(void) { return now_ns() / 1e9; }

static void sleep_until(double t) {
    double left = t - monotonic_s();
    if (left > 0) usleep((useconds_t)(left * 1e6));
}

#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16

/* The share workload (see the top of the file). */
static int share(const char *mode, unsigned long long iters, double calibrate_ms, int slot, double warmup_ms,
                 double seconds) {
    CUmodule module;
    CUfunction f;
    CUresult r = CU(cuModuleLoadData, CUmodule *, const void *)(&module, WORK_PTX);
    if (r == CUDA_SUCCESS) r = CU(cuModuleGetFunction, CUfunction *, CUmodule, const char *)(&f, module, "gpupool_work");
    CUdeviceptr out = 0;
    if (r == CUDA_SUCCESS) r = CU(cuMemAlloc, CUdeviceptr *, size_t)(&out, 4096);
    int sms = 0, per_sm = 0, block = 256;
    if (r == CUDA_SUCCESS) r = CU(cuDeviceGetAttribute, int *, int, CUdevice)(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device);
    if (r == CUDA_SUCCESS)
        r = CU(cuOccupancyMaxActiveBlocksPerMultiprocessor, int *, CUfunction, int, size_t)(&per_sm, f, block, 0);
    if (r != CUDA_SUCCESS || sms <= 0 || per_sm <= 0) {
        printf("{\"op\":\"share\",\"mode\":\"%s\",\"result\":%d}\n", mode, r);
        return 1;
    }
    /* The whole card, every block resident at once (what a cooperative launch needs). */
    unsigned grid = (unsigned)(sms * per_sm);
    int cooperative = !strcmp(mode, "cooperative");
    CU(cuStreamCreate, CUstream *, unsigned)(&stream, 0);
    CUresult (*plain)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                      void **, void **) =
        (CUresult(*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **,
                     void **))entry("cuLaunchKernel");
    CUresult (*coop)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **) =
        (CUresult(*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **))entry("cuLaunchCooperativeKernel");
    CUresult (*sync)(CUstream) = (CUresult(*)(CUstream))entry("cuStreamSynchronize");
    void *params[] = {&iters, &out};
#define LAUNCH() (cooperative ? coop(f, grid, 1, 1, block, 1, 1, 0, stream, params) \
                              : plain(f, grid, 1, 1, block, 1, 1, 0, stream, params, NULL))
    double launch_ms = 0;
    if (calibrate_ms > 0) {
        /* Alone on the card: scale the work until one launch takes about calibrate_ms. */
        iters = 100000;
        for (int round = 0; round < 6; round++) {
            r = LAUNCH();
            sync(stream);
            double t = now_ns();
            for (int i = 0; i < 3 && r == CUDA_SUCCESS; i++) r = LAUNCH();
            sync(stream);
            launch_ms = (now_ns() - t) / 3e6;
            if (r != CUDA_SUCCESS || launch_ms <= 0) break;
            iters = (unsigned long long)(iters * (calibrate_ms / launch_ms));
            if (iters < 1000) iters = 1000;
        }
    }
    printf("{\"op\":\"ready\",\"mode\":\"%s\",\"result\":%d}\n", mode, r);
    fflush(stdout);
    double start = 0;
    if (scanf("%lf", &start) != 1) return 2;
    double warm = start + slot * (warmup_ms / 1e3 + seconds), from = warm + warmup_ms / 1e3, until = from + seconds;
    sleep_until(warm);
    long launches = 0, in_flight = 0;
    while (monotonic_s() < from && r == CUDA_SUCCESS) {
        r = LAUNCH();
        if (++in_flight == 4) { sync(stream); in_flight = 0; }
    }
    sync(stream);
    double t0 = now_ns();
    in_flight = 0;
    while (monotonic_s() < until && r == CUDA_SUCCESS) {
        r = LAUNCH();
        launches++;
        if (++in_flight == 4) { sync(stream); in_flight = 0; }
    }
    sync(stream);
    double elapsed = (now_ns() - t0) / 1e9;
#undef LAUNCH
    printf("{\"op\":\"share\",\"mode\":\"%s\",\"result\":%d,\"iters\":%llu,\"grid\":%u,\"launch_ms\":%.3f,"
           "\"launches\":%ld,\"seconds\":%.3f,\"per_second\":%.3f}\n",
           mode, r, iters, grid, launch_ms, launches, elapsed, elapsed > 0 ? launches / elapsed : 0.0);
    return r != CUDA_SUCCESS;
}

static int nvml_check(void) {
    CUdeviceptr p = 0;
    CUresult r = CU(cuMemAlloc, CUdeviceptr *, size_t)(&p, 64 << 20);
    /* Kernels queued for about 1.5 s (1 ms each); NVML is asked after a second, while they run:
     * a process with no work in NVML's sample window gets no sample at all. */
    CUmodule module;
    CUfunction f;
    CU(cuModuleLoadData, CUmodule *, const void *)(&module, PTX);
    CU(cuModuleGetFunction, CUfunction *, CUmodule, const char *)(&f, module, "gpupool_spin");
    CU(cuStreamCreate, CUstream *, unsigned)(&stream, 0);
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **) =
        (CUresult(*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **, void **))entry("cuLaunchKernel");
    unsigned long long ms = 1000000;
    void *params[] = {&ms};
    for (int i = 0; i < 1500; i++) launch_kernel(f, 1, 1, 1, 32, 1, 1, 0, stream, params, NULL);
    usleep(1000000);
    char ns[64] = "";
    ssize_t len = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    if (len > 0) ns[len] = 0;
    printf("{\"op\":\"nvml\",\"alloc\":%d,\"pid\":%d,\"pid_namespace\":\"%s\",\"nvml\":%s", r, getpid(), ns,
           nvml ? "true" : "false");
    nvmlDevice_t d = nvml_device();
    if (d) {
        nvmlProcessInfo_t procs[64];
        unsigned count = 64;
        nvmlReturn_t q = NV(nvmlDeviceGetComputeRunningProcesses_v3, nvmlDevice_t, unsigned *, nvmlProcessInfo_t *)(
            d, &count, procs);
        printf(",\"processes\":{\"result\":%d,\"list\":[", q);
        for (unsigned i = 0; q == 0 && i < count; i++)
            printf("%s{\"pid\":%u,\"used\":%llu}", i ? "," : "", procs[i].pid, procs[i].usedGpuMemory);
        printf("]}");
        nvmlProcessUtilizationSample_t samples[64];
        unsigned n = 64;
        nvmlReturn_t u = NV(nvmlDeviceGetProcessUtilization, nvmlDevice_t, nvmlProcessUtilizationSample_t *,
                            unsigned *, unsigned long long)(d, samples, &n, 0);
        printf(",\"utilization\":{\"result\":%d,\"samples\":[", u);
        for (unsigned i = 0; u == 0 && i < n; i++)
            printf("%s{\"pid\":%u,\"sm\":%u}", i ? "," : "", samples[i].pid, samples[i].smUtil);
        printf("]}");
    }
    printf("}\n");
    CU(cuStreamSynchronize, CUstream)(stream);
    CU(cuMemFree, CUdeviceptr)(p);
    return 0;
}

static int procaddr(void) {
    static const char *pairs[][2] = {
        {"cuMemAlloc", "cuMemAlloc_v2"},       {"cuMemFree", "cuMemFree_v2"},
        {"cuMemGetInfo", "cuMemGetInfo_v2"},   {"cuLaunchKernel", "cuLaunchKernel"},
        {"cuMemAllocAsync", "cuMemAllocAsync"}, {"cuGraphLaunch", "cuGraphLaunch"},
        {"cuCtxCreate", "cuCtxCreate_v4"},     {"cuMemCreate", "cuMemCreate"},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        void *f = NULL;
        int status = -1;
        CUresult r = getproc(pairs[i][0], &f, 12080, 0, &status);
        void *exported = dlsym(cuda, pairs[i][1]);
        printf("{\"op\":\"procaddr\",\"symbol\":\"%s\",\"export\":\"%s\",\"result\":%d,\"status\":%d,"
               "\"same_as_export\":%s}\n",
               pairs[i][0], pairs[i][1], r, status, f && f == exported ? "true" : "false");
    }
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        fprintf(stderr, "usage: driver_check paths|launch|share|nvml|procaddr [options]\n");
        return 2;
    }
    const char *only = NULL, *mode = "eager";
    size_t chunk = 64 << 20;
    long count = 20000;
    unsigned long long iters = 0;
    double calibrate_ms = 0, warmup_ms = 1000, seconds = 3;
    int slot = 0;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--path")) only = argv[i + 1];
        else if (!strcmp(argv[i], "--chunk-mib")) chunk = strtoull(argv[i + 1], NULL, 10) << 20;
        else if (!strcmp(argv[i], "--count")) count = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--mode")) mode = argv[i + 1];
        else if (!strcmp(argv[i], "--iters")) iters = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--calibrate-ms")) calibrate_ms = strtod(argv[i + 1], NULL);
        else if (!strcmp(argv[i], "--slot")) slot = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--warmup-ms")) warmup_ms = strtod(argv[i + 1], NULL);
        else if (!strcmp(argv[i], "--seconds")) seconds = strtod(argv[i + 1], NULL);
    }
    if (!setup()) return 3;
    if (!strcmp(argv[1], "paths")) return paths(only, chunk);
    if (!strcmp(argv[1], "launch")) return launch(count, 0, 1);
    if (!strcmp(argv[1], "nvml")) return nvml_check();
    if (!strcmp(argv[1], "share")) return share(mode, iters, calibrate_ms, slot, warmup_ms, seconds);
    if (!strcmp(argv[1], "procaddr")) return procaddr();
    fprintf(stderr, "unknown subcommand %s\n", argv[1]);
    return 2;
}
