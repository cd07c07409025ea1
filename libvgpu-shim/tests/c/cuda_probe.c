/* Test program for libvgpu.so: calls the CUDA driver API directly (linked with -lcuda) and
 * through cuGetProcAddress_v2 the way cudart does. Every mode exits 0 on success and prints
 * "FAIL: ..." and exits 1 otherwise. Runs against the fake libcuda.so.1 in CI. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>
#include <pthread.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

typedef struct { int type, handleTypes, locType, locId; void *win32; unsigned char flags[8]; } CUmemAllocationProp;
typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR;

CUresult cuInit(unsigned);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, void *);
CUresult cuMemFreeAsync(CUdeviceptr, void *);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, void *, void *);
CUresult cuMemCreate(unsigned long long *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(unsigned long long);
CUresult cuArrayCreate_v2(unsigned long long *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArrayDestroy(unsigned long long);
CUresult cuMipmappedArrayCreate(unsigned long long *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned);
CUresult cuMipmappedArrayDestroy(unsigned long long);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuMemHostAlloc(void **, size_t, unsigned);
CUresult cuMemFreeHost(void *);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
CUresult cuCtxSynchronize(void);
/* Modules, libraries and memory pools. */
typedef struct { int allocType, handleTypes, locType, locId; void *win32; size_t maxSize; unsigned short usage; unsigned char reserved[54]; } CUmemPoolProps;
CUresult cuModuleLoad(void **, const char *);
CUresult cuModuleLoadData(void **, const void *);
CUresult cuModuleLoadDataEx(void **, const void *, unsigned, int *, void **);
CUresult cuModuleLoadFatBinary(void **, const void *);
CUresult cuModuleUnload(void *);
CUresult cuLibraryLoadData(void **, const void *, int *, void **, unsigned, int *, void **, unsigned);
CUresult cuLibraryLoadFromFile(void **, const char *, int *, void **, unsigned, int *, void **, unsigned);
CUresult cuLibraryUnload(void *);
CUresult cuDeviceGetMemPool(void **, CUdevice);
CUresult cuMemPoolCreate(void **, const CUmemPoolProps *);
CUresult cuMemPoolDestroy(void *);
CUresult cuMemPoolTrimTo(void *, size_t);
CUresult cuMemPoolSetAttribute(void *, int, void *);
CUresult cuMemPoolGetAttribute(void *, int, void *);
CUresult cuStreamSynchronize(void *);
CUresult cuCtxGetCurrent(CUcontext *);
CUresult cuCtxSetCurrent(CUcontext);
/* Pre-4.0 and multi-device launches, streams. */
typedef struct { void *function; unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes; void *hStream; void **kernelParams; } CUDA_LAUNCH_PARAMS;
CUresult cuLaunch(void *);
CUresult cuLaunchGrid(void *, int, int);
CUresult cuLaunchGridAsync(void *, int, int, void *);
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *, unsigned, unsigned);
CUresult cuStreamCreate(void **, unsigned);
/* Graphs with memory nodes. */
typedef struct { int allocType, handleTypes, locType, locId; void *win32; unsigned char tail[64]; const void *accessDescs; size_t accessDescCount; size_t bytesize; CUdeviceptr dptr; } CUDA_MEM_ALLOC_NODE_PARAMS;
typedef struct { unsigned long long flags; void *hUploadStream; void *hErrNode_out; int result_out; } CUDA_GRAPH_INSTANTIATE_PARAMS;
CUresult cuGraphCreate(void **, unsigned);
CUresult cuGraphDestroy(void *);
CUresult cuGraphAddMemAllocNode(void **, void *, void **, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphAddMemFreeNode(void **, void *, void **, size_t, CUdeviceptr);
CUresult cuGraphAddEmptyNode(void **, void *, void **, size_t);
CUresult cuGraphInstantiate(void **, void *, void **, char *, size_t);
CUresult cuGraphInstantiate_v2(void **, void *, void **, char *, size_t);
CUresult cuGraphInstantiateWithFlags(void **, void *, unsigned long long);
CUresult cuGraphInstantiateWithParams(void **, void *, CUDA_GRAPH_INSTANTIATE_PARAMS *);
CUresult cuGraphExecDestroy(void *);
CUresult cuGraphLaunch(void *, void *);
CUresult cuDeviceGraphMemTrim(CUdevice);
/* The legacy (CUDA 3.1 ABI) entry points: 32-bit pointers and sizes. */
typedef struct { unsigned Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR_v1;
typedef struct { unsigned Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR_v1;
CUresult cuMemAlloc(unsigned *, unsigned);
CUresult cuMemAllocPitch(unsigned *, unsigned *, unsigned, unsigned, unsigned);
CUresult cuMemFree(unsigned);
CUresult cuMemGetInfo(unsigned *, unsigned *);
CUresult cuDeviceTotalMem(unsigned *, CUdevice);
CUresult cuArrayCreate(unsigned long long *, const CUDA_ARRAY_DESCRIPTOR_v1 *);
CUresult cuArray3DCreate(unsigned long long *, const CUDA_ARRAY3D_DESCRIPTOR_v1 *);

#define OOM 2
static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); failures++; } } while (0)
#define EXPECT(call, want) do { CUresult r_ = (call); CHECK(r_ == (want), "%s returned %d, expected %d", #call, r_, (want)); } while (0)

static void setup(void) {
    CUdevice dev; CUcontext ctx;
    EXPECT(cuInit(0), 0);
    EXPECT(cuDeviceGet(&dev, 0), 0);
    EXPECT(cuCtxCreate_v2(&ctx, 0, dev), 0);
}

static int done(void) {
    if (failures) { printf("%d failure(s)\n", failures); return 1; }
    printf("OK\n");
    return 0;
}

/* Direct calls: every allocation path is counted against LIMIT. */
static int mode_limit(size_t limit) {
    setup();
    size_t free_b = 0, total = 0;
    EXPECT(cuMemGetInfo_v2(&free_b, &total), 0);
    CHECK(total == limit && free_b == limit, "cuMemGetInfo: free %zu total %zu, limit %zu", free_b, total, limit);
    size_t tm = 0;
    EXPECT(cuDeviceTotalMem_v2(&tm, 0), 0);
    CHECK(tm == limit, "cuDeviceTotalMem %zu, limit %zu", tm, limit);

    CUdeviceptr p = 0, q = 0;
    EXPECT(cuMemAlloc_v2(&p, limit), 0);           /* exactly the limit: fits */
    EXPECT(cuMemAlloc_v2(&q, 1), OOM);             /* one byte past: OOM */
    EXPECT(cuMemGetInfo_v2(&free_b, &total), 0);
    CHECK(free_b == 0 && total == limit, "after full alloc: free %zu total %zu", free_b, total);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuMemAlloc_v2(&p, limit - 1), 0);
    EXPECT(cuMemAlloc_v2(&q, 1), 0);
    EXPECT(cuMemAlloc_v2(&q, 1), OOM);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuMemFree_v2(q), 0);
    EXPECT(cuMemFree_v2(0), 0);
    /* An untracked pointer is forwarded: the driver's own error, not -1. */
    EXPECT(cuMemFree_v2(0xdeadbeef000ULL), 1);

    /* Managed memory counts. */
    EXPECT(cuMemAllocManaged(&p, limit - 1, 1), 0);
    EXPECT(cuMemAlloc_v2(&q, 2), OOM);
    EXPECT(cuMemFree_v2(p), 0);
    /* Pitch counts the real pitch (rows rounded to 512 bytes by the fake driver). */
    size_t pitch = 0;
    /* 1000-byte rows are 1024 bytes apart: limit/1024 rows fill the limit exactly (HAMi-core
     * charged width x height and would let more through). */
    EXPECT(cuMemAllocPitch_v2(&p, &pitch, 1000, limit / 1024, 4), 0);
    CHECK(pitch == 1024, "pitch %zu", pitch);
    EXPECT(cuMemAlloc_v2(&q, 1 + limit % 1024), OOM);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuMemAllocPitch_v2(&p, &pitch, 1000, limit / 1024 + 1, 4), OOM);
    /* Async and pool allocations count and are released by cuMemFreeAsync. The pool gives its
       memory back to the device at the next synchronisation (release threshold 0), as the
       driver does: without it a limit as large as the card would leave nothing for cuMemCreate. */
    EXPECT(cuMemAllocAsync(&p, limit, 0), 0);
    EXPECT(cuMemAllocFromPoolAsync(&q, 1, 0, 0), OOM);
    EXPECT(cuMemFreeAsync(p, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    EXPECT(cuMemAllocFromPoolAsync(&p, limit, 0, 0), 0);
    EXPECT(cuMemFreeAsync(p, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    /* VMM: charged to the device in the properties, released by cuMemRelease. */
    CUmemAllocationProp prop; memset(&prop, 0, sizeof prop);
    prop.type = 1; prop.locType = 1; prop.locId = 0;
    unsigned long long h = 0, h2 = 0;
    size_t gran = 2 << 20, vmm = (limit / gran) * gran;
    EXPECT(cuMemCreate(&h, vmm, &prop, 0), 0);
    EXPECT(cuMemCreate(&h2, gran, &prop, 0), limit - vmm >= gran ? 0 : OOM);
    if (limit - vmm >= gran) EXPECT(cuMemRelease(h2), 0);
    EXPECT(cuMemRelease(h), 0);
    /* Arrays: width x height x channels x element size. */
    CUDA_ARRAY_DESCRIPTOR d = { 1024, limit / 4096, 0x03 /* u32 */, 1 };
    unsigned long long arr = 0;
    EXPECT(cuArrayCreate_v2(&arr, &d), 0);
    EXPECT(cuMemAlloc_v2(&q, (limit % 4096) + 1), OOM);
    EXPECT(cuArrayDestroy(arr), 0);
    /* Mipmapped arrays: every level counts, each dimension halved per level. A 2048-wide u8
       array of height mh: level 0 is 2048*mh bytes, level 1 1024*(mh/2), level 2 512*(mh/4). */
    size_t mh = (limit / 2560) & ~(size_t)3;
    size_t two = 2048 * mh + 1024 * (mh / 2), three = two + 512 * (mh / 4);
    CUDA_ARRAY3D_DESCRIPTOR md = { 2048, mh, 0, 0x01 /* u8 */, 1, 0 };
    EXPECT(cuMipmappedArrayCreate(&arr, &md, 2), 0);
    EXPECT(cuMemAlloc_v2(&q, limit - two + 1), OOM);
    EXPECT(cuMipmappedArrayDestroy(arr), 0);
    EXPECT(cuMipmappedArrayCreate(&arr, &md, 3), three > limit ? OOM : 0);
    if (three <= limit) EXPECT(cuMipmappedArrayDestroy(arr), 0);
    /* Host memory is not device memory. */
    void *host = 0;
    EXPECT(cuMemAlloc_v2(&p, limit), 0);
    EXPECT(cuMemHostAlloc(&host, 1 << 20, 0), 0);
    EXPECT(cuMemFreeHost(host), 0);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuMemGetInfo_v2(&free_b, &total), 0);
    CHECK(free_b == limit, "everything freed: free %zu of %zu", free_b, limit);
    return done();
}

typedef CUresult (*GetProc2)(const char *, void **, int, unsigned long long, int *);
typedef const char *(*ResolveName)(const char *, int, unsigned long long);
typedef unsigned long long (*Calls)(const char *);

/* Through cuGetProcAddress_v2, the way cudart gets every entry point. */
static int mode_procaddr(size_t limit, int version, unsigned long long flags) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib, "dlopen libcuda.so.1: %s", dlerror());
    if (!lib) return done();
    GetProc2 gpa = (GetProc2)dlsym(lib, "cuGetProcAddress_v2");
    ResolveName expected = (ResolveName)dlsym(lib, "fake_cuda_resolve_name");
    Calls calls = (Calls)dlsym(lib, "fake_cuda_calls");
    CHECK(gpa && expected && calls, "driver symbols missing");
    Dl_info info;
    CHECK(dladdr((void *)gpa, &info) && strstr(info.dli_fname, "libvgpu"), "dlsym(cuGetProcAddress_v2) is not the shim's");
    const char *names[] = { "cuInit", "cuDeviceGet", "cuCtxCreate", "cuMemAlloc", "cuMemFree", "cuMemGetInfo",
                            "cuMemAllocAsync", "cuMemFreeAsync", "cuLaunchKernel", "cuLaunchKernelEx", "cuGraphLaunch",
                            "cuStreamSynchronize", "cuDeviceTotalMem", "cuGetProcAddress", "cuMemAllocFromPoolAsync", 0 };
    const char *hooked[] = { "cuInit", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2", "cuMemAllocAsync",
                             "cuMemAllocAsync_ptsz", "cuMemFreeAsync", "cuMemFreeAsync_ptsz", "cuLaunchKernel",
                             "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuGraphLaunch",
                             "cuGraphLaunch_ptsz", "cuDeviceTotalMem_v2", "cuGetProcAddress", "cuGetProcAddress_v2",
                             "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", 0 };
    void *fns[32] = {0};
    for (int i = 0; names[i]; i++) {
        int status = -1;
        CUresult r = gpa(names[i], &fns[i], version, flags, &status);
        const char *want = expected(names[i], version, flags);
        if (!want) {
            CHECK(r == 500 && fns[i] == 0 && status != 0, "%s@%d: expected not found, got %d/%d", names[i], version, r, status);
            continue;
        }
        CHECK(r == 0 && status == 0 && fns[i], "%s@%d flags %llu: result %d status %d", names[i], version, flags, r, status);
        if (!fns[i]) continue;
        if (!dladdr(fns[i], &info) || !info.dli_sname) { CHECK(0, "%s@%d flags %llu: pointer %p is no exported symbol (not wrapped)", names[i], version, flags, fns[i]); continue; }
        /* The same symbol the driver chose, and the shim's wrapper of it when hooked. */
        CHECK(strcmp(info.dli_sname, want) == 0, "%s@%d flags %llu: got %s, driver would give %s", names[i], version, flags, info.dli_sname, want);
        int is_hooked = 0;
        for (int k = 0; hooked[k]; k++) if (strcmp(hooked[k], want) == 0) is_hooked = 1;
        int in_shim = strstr(info.dli_fname, "libvgpu") != 0;
        CHECK(is_hooked == in_shim, "%s -> %s from %s (hooked %d)", names[i], want, info.dli_fname, is_hooked);
    }
    CUresult (*init)(unsigned) = fns[0];
    CUresult (*devget)(CUdevice *, int) = fns[1];
    CUresult (*ctxcreate)(CUcontext *, unsigned, CUdevice) = fns[2];
    CUresult (*alloc)(CUdeviceptr *, size_t) = fns[3];
    CUresult (*freep)(CUdeviceptr) = fns[4];
    CUresult (*meminfo)(size_t *, size_t *) = fns[5];
    CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **) = fns[8];
    CUdevice dev; CUcontext ctx; CUdeviceptr p, q;
    EXPECT(init(0), 0);
    EXPECT(devget(&dev, 0), 0);
    EXPECT(ctxcreate(&ctx, 0, dev), 0);
    size_t f = 0, t = 0;
    EXPECT(meminfo(&f, &t), 0);
    CHECK(t == limit && f == limit, "meminfo %zu/%zu, limit %zu", f, t, limit);
    EXPECT(alloc(&p, limit), 0);
    EXPECT(alloc(&q, 1), OOM);
    EXPECT(freep(p), 0);
    if (fns[6]) {
        CUresult (*aalloc)(CUdeviceptr *, size_t, void *) = fns[6];
        EXPECT(aalloc(&p, limit, 0), 0);
        EXPECT(aalloc(&q, 1, 0), OOM);
        CUresult (*afree)(CUdeviceptr, void *) = fns[7];
        EXPECT(afree(p, 0), 0);
    }
    const char *lname = expected("cuLaunchKernel", version, flags);
    unsigned long long before = calls(lname);
    EXPECT(launch((void *)1, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0), 0);
    CHECK(calls(lname) == before + 1, "launch did not reach the driver's %s", lname);
    /* cuGetProcAddress for itself returns the shim's wrapper of the variant the driver picks. */
    if (fns[13]) {
        CHECK(dladdr(fns[13], &info) && strstr(info.dli_fname, "libvgpu"), "cuGetProcAddress not wrapped");
    }
    return done();
}

/* dlsym(RTLD_NEXT, ...) stays relative to the caller, and repeated lookups work. */
static int mode_dlsym(void) {
    void *a = dlsym(RTLD_NEXT, "puts"), *b = dlsym(RTLD_NEXT, "puts");
    CHECK(a && a == b, "dlsym(RTLD_NEXT, puts) twice: %p %p", a, b);
    /* From the executable, "next" includes the preloaded shim itself. */
    void *w = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    Dl_info info;
    CHECK(w && dladdr(w, &info) && strstr(info.dli_fname, "libvgpu"), "RTLD_NEXT is not caller-relative");
    CHECK(dlsym(RTLD_DEFAULT, "no_such_symbol_xyz") == 0, "missing symbol found");
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    CHECK(lib && dlsym(lib, "cuNoSuchFunction") == 0, "unknown cu* symbol must stay NULL");
    void *m = lib ? dlsym(lib, "cuMemAlloc_v2") : 0;
    CHECK(m && dladdr(m, &info) && strstr(info.dli_fname, "libvgpu"), "dlsym(libcuda, cuMemAlloc_v2) not hooked");
    void *s = lib ? dlsym(lib, "cuCtxSynchronize") : 0;
    CHECK(s && dladdr(s, &info) && strstr(info.dli_fname, "libcuda"), "unhooked symbol must be the driver's");
    return done();
}

static double now_s(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec / 1e9; }

/* Race: wait for the start file, allocate CHUNK until OOM, report, then hold. */
static int mode_hold(size_t chunk, const char *start_file, const char *report) {
    setup();
    while (access(start_file, F_OK) != 0) usleep(200);
    int n = 0; CUdeviceptr p;
    while (n < 100000 && cuMemAlloc_v2(&p, chunk) == 0) n++;
    FILE *f = fopen(report, "w");
    if (f) { fprintf(f, "%d\n", n); fclose(f); }
    for (;;) pause();
    return 0;
}

/* A loader trick the preload cannot see (a "custom loader"): after registering through the
 * hooked driver (setup), load a second copy of libcuda.so.1 in a new link-map namespace
 * (dlmopen: no preload is loaded there) and allocate MIB MiB through it, report, then hold. The
 * shim's region lists this process; only the driver's per-process count shows what it took. */
#ifdef __GLIBC__
static int mode_bypass(size_t mib, const char *report) {
    setup();
    void *lib = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib, "dlmopen libcuda.so.1: %s", dlerror());
    if (!lib) return done();
    /* The shim answers dlsym for cu* names with its wrappers, whatever the handle; that
     * namespace's own libc has a dlsym it does not reach. */
    Lmid_t lmid = 0;
    CHECK(dlinfo(lib, RTLD_DI_LMID, &lmid) == 0, "dlinfo: %s", dlerror());
    void *libc2 = dlmopen(lmid, "libc.so.6", RTLD_NOW | RTLD_LOCAL);
    void *(*sym)(void *, const char *) = libc2 ? (void *(*)(void *, const char *))dlsym(libc2, "dlsym") : 0;
    CHECK(sym, "the second namespace's dlsym");
    if (!sym) return done();
    CUresult (*init)(unsigned) = (CUresult (*)(unsigned))sym(lib, "cuInit");
    CUresult (*get)(CUdevice *, int) = (CUresult (*)(CUdevice *, int))sym(lib, "cuDeviceGet");
    CUresult (*create)(CUcontext *, unsigned, CUdevice) = (CUresult (*)(CUcontext *, unsigned, CUdevice))sym(lib, "cuCtxCreate_v2");
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))sym(lib, "cuMemAlloc_v2");
    CHECK(init && get && create && alloc, "the second copy's entry points");
    if (!(init && get && create && alloc)) return done();
    CUdevice dev; CUcontext ctx; CUdeviceptr p;
    EXPECT(init(0), 0);
    EXPECT(get(&dev, 0), 0);
    EXPECT(create(&ctx, 0, dev), 0);
    size_t got = 0;
    while (got < mib && alloc(&p, (size_t)1 << 20) == 0) got++;
    FILE *f = fopen(report, "w");
    if (f) { fprintf(f, "%zu\n", got); fclose(f); }
    for (;;) pause();
    return 0;
}
#else
/* musl has no link-map namespaces (dlmopen). */
static int mode_bypass(size_t mib, const char *report) {
    (void)mib; (void)report;
    printf("FAIL: bypass needs glibc's dlmopen\n");
    return 1;
}
#endif

/* After others die, allocate CHUNK within TIMEOUT seconds; prints the delay. */
static int mode_grab(size_t chunk, double timeout) {
    setup();
    double t0 = now_s(); CUdeviceptr p;
    while (cuMemAlloc_v2(&p, chunk) != 0) {
        if (now_s() - t0 > timeout) { printf("FAIL: no memory after %.3f s\n", now_s() - t0); return 1; }
        usleep(1000);
    }
    printf("grabbed after %.3f s\n", now_s() - t0);
    return 0;
}

/* nvidia-smi's view: nvmlDeviceGetMemoryInfo(_v2) report the limit and the container's usage. */
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
static int mode_nvml(size_t limit) {
    setup();
    CUdeviceptr p;
    EXPECT(cuMemAlloc_v2(&p, limit / 4), 0);
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    CHECK(lib, "dlopen libnvidia-ml.so.1");
    if (!lib) return done();
    int (*init)(void) = dlsym(lib, "nvmlInit_v2");
    int (*handle)(unsigned, void **) = dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    int (*info)(void *, nvmlMemory_t *) = dlsym(lib, "nvmlDeviceGetMemoryInfo");
    int (*info2)(void *, nvmlMemory_v2_t *) = dlsym(lib, "nvmlDeviceGetMemoryInfo_v2");
    CHECK(init && handle && info && info2, "nvml symbols");
    void *dev = 0;
    EXPECT(init(), 0);
    EXPECT(handle(0, &dev), 0);
    nvmlMemory_t m; memset(&m, 0, sizeof m);
    EXPECT(info(dev, &m), 0);
    CHECK(m.total == limit && m.used == limit / 4 && m.free == limit - limit / 4,
          "nvmlDeviceGetMemoryInfo total %llu used %llu free %llu", m.total, m.used, m.free);
    nvmlMemory_v2_t m2; memset(&m2, 0, sizeof m2);
    m2.version = sizeof m2 | (2 << 24);
    EXPECT(info2(dev, &m2), 0);
    CHECK(m2.total == limit && m2.used == limit / 4, "v2 total %llu used %llu", m2.total, m2.used);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(info(dev, &m), 0);
    CHECK(m.used == 0 && m.free == limit, "after free: used %llu free %llu", m.used, m.free);
    return done();
}

/* What nvidia-smi reads besides memory: every running-process list (compute, graphics, MPS; the
 * unversioned, _v2 and _v3 calls, NVML's two-call protocol) and the utilization calls. Prints
 * one line per call; the test judges them. BYTES > 0: allocate that much first; then, with
 * WAIT > 0, sleep WAIT seconds before reading (another process meanwhile sets things up). */
typedef struct { unsigned pid; unsigned long long used; } nvmlProcessInfo_v1_t;
typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; } nvmlProcessInfo_t;
typedef struct { unsigned pid; unsigned long long ts; unsigned sm, mem, enc, dec; } nvmlProcessUtilizationSample_t;
typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
static int mode_smi(size_t bytes, double wait) {
    CUdeviceptr p = 0;
    if (bytes) { setup(); EXPECT(cuMemAlloc_v2(&p, bytes), 0); }
    if (wait > 0) usleep((useconds_t)(wait * 1e6));
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    CHECK(lib, "dlopen libnvidia-ml.so.1");
    if (!lib) return done();
    int (*init)(void) = dlsym(lib, "nvmlInit_v2");
    int (*handle)(unsigned, void **) = dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    CHECK(init && handle, "nvml symbols");
    void *dev = 0;
    EXPECT(init(), 0);
    EXPECT(handle(0, &dev), 0);
    printf("PID %d\n", getpid());
    static const char *const lists[] = {
        "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    };
    for (unsigned i = 0; i < sizeof lists / sizeof *lists; i++) {
        int v1 = !strchr(lists[i] + 20, '_');
        int (*f)(void *, unsigned *, void *) = dlsym(lib, lists[i]);
        CHECK(f, "%s", lists[i]);
        if (!f) continue;
        unsigned n = 0;
        int r = f(dev, &n, 0);
        CHECK(r == 0 || r == 7, "%s size query returned %d", lists[i], r);
        unsigned cap = n + 4;
        void *buf = calloc(cap, sizeof(nvmlProcessInfo_t));
        n = cap;
        EXPECT(f(dev, &n, buf), 0);
        printf("LIST %s n=%u", lists[i], n);
        for (unsigned k = 0; k < n; k++) {
            if (v1) printf(" %u:%llu", ((nvmlProcessInfo_v1_t *)buf)[k].pid, ((nvmlProcessInfo_v1_t *)buf)[k].used);
            else printf(" %u:%llu", ((nvmlProcessInfo_t *)buf)[k].pid, ((nvmlProcessInfo_t *)buf)[k].used);
        }
        printf("\n");
        free(buf);
    }
    int (*rates)(void *, nvmlUtilization_t *) = dlsym(lib, "nvmlDeviceGetUtilizationRates");
    int (*procutil)(void *, nvmlProcessUtilizationSample_t *, unsigned *, unsigned long long) =
        dlsym(lib, "nvmlDeviceGetProcessUtilization");
    CHECK(rates && procutil, "utilization symbols");
    if (rates && procutil) {
        nvmlUtilization_t u = {0, 0};
        EXPECT(rates(dev, &u), 0);
        printf("UTIL gpu=%u memory=%u\n", u.gpu, u.memory);
        struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
        unsigned long long since = (unsigned long long)ts.tv_sec * 1000000ull + ts.tv_nsec / 1000 - 1000000ull;
        nvmlProcessUtilizationSample_t samples[64];
        unsigned n = 64;
        int r = procutil(dev, samples, &n, since);
        CHECK(r == 0 || r == 6, "nvmlDeviceGetProcessUtilization returned %d", r);
        printf("SAMPLES n=%u", r == 0 ? n : 0);
        for (unsigned k = 0; r == 0 && k < n; k++) printf(" %u:%u", samples[k].pid, samples[k].sm);
        printf("\n");
    }
    /* NVML 12.4's forms: one list call with a mode, the utilization info struct; accounting. */
    typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; unsigned long long cc; } nvmlProcessDetail_v1_t;
    typedef struct { unsigned version, mode, num; nvmlProcessDetail_v1_t *array; } nvmlProcessDetailList_v1_t;
    typedef struct { unsigned long long ts; unsigned pid, sm, mem, enc, dec, jpg, ofa; } nvmlProcessUtilizationInfo_v1_t;
    typedef struct { unsigned version, count; unsigned long long last_seen; nvmlProcessUtilizationInfo_v1_t *array; } nvmlProcessesUtilizationInfo_v1_t;
    int (*detail)(void *, nvmlProcessDetailList_v1_t *) = dlsym(lib, "nvmlDeviceGetRunningProcessDetailList");
    int (*utilinfo)(void *, nvmlProcessesUtilizationInfo_v1_t *) = dlsym(lib, "nvmlDeviceGetProcessesUtilizationInfo");
    int (*accounting)(void *, unsigned *, unsigned *) = dlsym(lib, "nvmlDeviceGetAccountingPids");
    CHECK(detail && utilinfo && accounting, "NVML 12.4 symbols");
    for (unsigned mode = 0; detail && mode < 3; mode++) {
        nvmlProcessDetailList_v1_t l = { sizeof l | (1u << 24), mode, 0, 0 };
        int r = detail(dev, &l);
        CHECK(r == 0 || r == 7, "detail size query (mode %u) returned %d", mode, r);
        nvmlProcessDetail_v1_t entries[64];
        l.num = 64; l.array = entries;
        EXPECT(detail(dev, &l), 0);
        printf("LIST detail%u n=%u", mode, l.num);
        for (unsigned k = 0; k < l.num; k++) printf(" %u:%llu", entries[k].pid, entries[k].used);
        printf("\n");
    }
    if (utilinfo) {
        struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
        nvmlProcessUtilizationInfo_v1_t entries[64];
        nvmlProcessesUtilizationInfo_v1_t u = { sizeof u | (1u << 24), 64,
            (unsigned long long)ts.tv_sec * 1000000ull + ts.tv_nsec / 1000 - 1000000ull, entries };
        int r = utilinfo(dev, &u);
        CHECK(r == 0 || r == 6, "nvmlDeviceGetProcessesUtilizationInfo returned %d", r);
        printf("SAMPLES2 n=%u", r == 0 ? u.count : 0);
        for (unsigned k = 0; r == 0 && k < u.count; k++) printf(" %u:%u", entries[k].pid, entries[k].sm);
        printf("\n");
    }
    if (accounting) {
        unsigned pids[64], n = 64;
        int r = accounting(dev, &n, pids);
        CHECK(r == 0, "nvmlDeviceGetAccountingPids returned %d", r);
        printf("LIST accounting n=%u", r == 0 ? n : 0);
        for (unsigned k = 0; r == 0 && k < n; k++) printf(" %u:0", pids[k]);
        printf("\n");
    }
    if (p) EXPECT(cuMemFree_v2(p), 0);
    return done();
}

/* Many threads allocating against one limit: exactly limit/chunk allocations succeed. */
static size_t g_chunk;
static CUcontext g_ctx;
CUresult cuCtxSetCurrent(CUcontext);
static void *alloc_until_oom(void *arg) {
    long *n = arg; CUdeviceptr p;
    cuCtxSetCurrent(g_ctx);
    while (cuMemAlloc_v2(&p, g_chunk) == 0) (*n)++;
    return 0;
}
static int mode_threads(size_t limit) {
    CUdevice dev;
    EXPECT(cuInit(0), 0);
    EXPECT(cuDeviceGet(&dev, 0), 0);
    EXPECT(cuCtxCreate_v2(&g_ctx, 0, dev), 0);
    g_chunk = limit / 64;
    pthread_t t[8]; long n[8] = {0};
    for (int i = 0; i < 8; i++) pthread_create(&t[i], 0, alloc_until_oom, &n[i]);
    long total = 0;
    for (int i = 0; i < 8; i++) { pthread_join(t[i], 0); total += n[i]; }
    CHECK(total == 64, "threads allocated %ld chunks, expected 64", total);
    size_t f = 0, tot = 0;
    EXPECT(cuMemGetInfo_v2(&f, &tot), 0);
    CHECK(f == limit - 64 * g_chunk, "free %zu", f);
    return done();
}

/* fork: the child gets its own slot; its exit releases only its own share. */
static int mode_fork(size_t limit) {
    setup();
    CUdeviceptr a, b, c;
    EXPECT(cuMemAlloc_v2(&a, limit / 2), 0);
    pid_t pid = fork();
    if (pid == 0) {
        EXPECT(cuMemAlloc_v2(&b, limit / 2), 0);
        EXPECT(cuMemAlloc_v2(&c, 1), OOM);
        exit(failures ? 1 : 0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child failed (status %d)", st);
    EXPECT(cuMemAlloc_v2(&b, limit / 2), 0);
    EXPECT(cuMemAlloc_v2(&c, 1), OOM);
    return done();
}

/* The legacy entry points, reached directly, through dlsym and through cuGetProcAddress with a
 * pre-3.2 version, are counted like the _v2 ones (the review's attack: 7 x 1536 MiB through
 * cuMemAlloc under a 1024 MiB limit). LIMIT must fit in 32 bits. */
typedef CUresult (*Alloc1)(unsigned *, unsigned);
typedef CUresult (*Free1)(unsigned);
typedef CUresult (*Pitch1)(unsigned *, unsigned *, unsigned, unsigned, unsigned);
static void legacy_round(const char *how, Alloc1 alloc, Free1 freep, Pitch1 pitchf, size_t limit) {
    unsigned p = 0, q = 0, pitch = 0;
    CUresult r = alloc(&p, (unsigned)limit);
    CHECK(r == 0, "%s: cuMemAlloc(limit) returned %d", how, r);
    r = alloc(&q, 1);
    CHECK(r == OOM, "%s: cuMemAlloc(1) past the limit returned %d", how, r);
    CUdeviceptr wide = 0;
    EXPECT(cuMemAlloc_v2(&wide, 1), OOM);
    if (p) EXPECT(freep(p), 0);
    /* Freed: the whole limit is available again. */
    EXPECT(cuMemAlloc_v2(&wide, limit), 0);
    EXPECT(cuMemFree_v2(wide), 0);
    /* Pitch: the real pitch x height is charged. */
    r = pitchf(&p, &pitch, 1000, (unsigned)(limit / 1024), 4);
    CHECK(r == 0 && pitch == 1024, "%s: cuMemAllocPitch returned %d pitch %u", how, r, pitch);
    EXPECT(cuMemAlloc_v2(&wide, 1 + limit % 1024), OOM);
    if (r == 0) EXPECT(freep(p), 0);
    r = pitchf(&p, &pitch, 1000, (unsigned)(limit / 1024 + 1), 4);
    CHECK(r == OOM, "%s: cuMemAllocPitch past the limit returned %d", how, r);
    /* The review's attack: 7 x 1536 MiB. Every one is refused under a smaller limit. */
    int got = 0;
    for (int i = 0; i < 7; i++) if (alloc(&q, 1536u << 20) == 0) got++;
    CHECK(limit >= (1536u << 20) || got == 0, "%s: %d x 1536 MiB allocated under a %zu-byte limit", how, got, limit);
}

static int mode_legacy(size_t limit) {
    setup();
    unsigned f = 0, t = 0, tm = 0;
    EXPECT(cuMemGetInfo(&f, &t), 0);
    CHECK(t == limit && f == limit, "cuMemGetInfo (v1): free %u total %u, limit %zu", f, t, limit);
    EXPECT(cuDeviceTotalMem(&tm, 0), 0);
    CHECK(tm == limit, "cuDeviceTotalMem (v1) %u, limit %zu", tm, limit);
    legacy_round("direct", cuMemAlloc, cuMemFree, cuMemAllocPitch, limit);
    /* A v1 pointer freed through cuMemFree_v2 is uncounted too. */
    unsigned p = 0; CUdeviceptr wide = 0;
    EXPECT(cuMemAlloc(&p, (unsigned)limit), 0);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuMemAlloc_v2(&wide, limit), 0);
    EXPECT(cuMemFree_v2(wide), 0);
    /* v1 arrays. */
    CUDA_ARRAY_DESCRIPTOR_v1 d = { 1024, (unsigned)(limit / 4096), 0x03, 1 };
    unsigned long long arr = 0;
    EXPECT(cuArrayCreate(&arr, &d), 0);
    EXPECT(cuMemAlloc_v2(&wide, 1), OOM);
    EXPECT(cuArrayDestroy(arr), 0);
    CUDA_ARRAY3D_DESCRIPTOR_v1 d3 = { 1024, (unsigned)(limit / 4096), 1, 0x03, 1, 0 };
    EXPECT(cuArray3DCreate(&arr, &d3), 0);
    EXPECT(cuMemAlloc_v2(&wide, 1), OOM);
    EXPECT(cuArrayDestroy(arr), 0);
    /* Through dlsym on the driver's handle. */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    CHECK(lib, "dlopen libcuda.so.1");
    if (!lib) return done();
    Alloc1 a = (Alloc1)dlsym(lib, "cuMemAlloc");
    Free1 fr = (Free1)dlsym(lib, "cuMemFree");
    Pitch1 pi = (Pitch1)dlsym(lib, "cuMemAllocPitch");
    Dl_info info;
    CHECK(a && dladdr((void *)a, &info) && strstr(info.dli_fname, "libvgpu"), "dlsym(cuMemAlloc) is not the shim's");
    if (a && fr && pi) legacy_round("dlsym", a, fr, pi, limit);
    /* Through cuGetProcAddress with a version before 3.2 (what a CUDA 3.1 program asks for). */
    GetProc2 gpa = (GetProc2)dlsym(lib, "cuGetProcAddress_v2");
    void *ga = 0, *gf = 0, *gp = 0; int st = 0;
    EXPECT(gpa("cuMemAlloc", &ga, 3010, 0, &st), 0);
    EXPECT(gpa("cuMemFree", &gf, 3010, 0, &st), 0);
    EXPECT(gpa("cuMemAllocPitch", &gp, 3010, 0, &st), 0);
    CHECK(ga && dladdr(ga, &info) && strstr(info.dli_fname, "libvgpu") && !strcmp(info.dli_sname, "cuMemAlloc"),
          "cuGetProcAddress(cuMemAlloc, 3010) is not the shim's cuMemAlloc");
    if (ga && gf && gp) legacy_round("cuGetProcAddress", (Alloc1)ga, (Free1)gf, (Pitch1)gp, limit);
    EXPECT(cuMemGetInfo(&f, &t), 0);
    CHECK(f == limit, "everything freed: free %u of %zu", f, limit);
    return done();
}

/* fork, then the parent exits: the child is counted in its own slot, is not charged for the
 * parent's allocations, gets the parent's share back when the parent is gone, and its own
 * allocations count for the rest of the container (a grandchild sees them). The child reports on
 * stdout ("child OK" / FAIL lines); the parent's exit status is its own. */
static int mode_forkexit(size_t limit) {
    setup();
    CUdeviceptr a, b, c;
    EXPECT(cuMemAlloc_v2(&a, limit / 2), 0);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) { CHECK(0, "fork"); return done(); }
    if (pid > 0) return done(); /* the parent exits at once, holding limit/2 */
    alarm(20);
    double t0 = now_s();
    while (getppid() == parent && now_s() - t0 < 10) usleep(1000);
    CHECK(getppid() != parent, "parent did not exit");
    /* Freeing the parent's pointer in the child must not uncount anything from the child. */
    EXPECT(cuMemAlloc_v2(&b, limit / 2), 0);
    cuMemFree_v2(a);
    size_t f = 0, t = 0;
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    CHECK(f == limit - limit / 2, "child after parent exit: free %zu, expected %zu", f, limit - limit / 2);
    EXPECT(cuMemAlloc_v2(&c, limit - limit / 2), 0);
    EXPECT(cuMemAlloc_v2(&a, 1), OOM);
    pid_t g = fork();
    if (g == 0) {
        CUdeviceptr x;
        CUresult r = cuMemAlloc_v2(&x, 1);
        if (r != OOM) printf("FAIL: grandchild allocated past the child's usage (%d)\n", r);
        exit(r == OOM ? 0 : 1);
    }
    int st = 0;
    waitpid(g, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "grandchild status %d", st);
    EXPECT(cuMemFree_v2(b), 0);
    EXPECT(cuMemFree_v2(c), 0);
    if (failures) { printf("child: %d failure(s)\n", failures); return 1; }
    printf("child OK\n");
    return 0;
}

/* Threads allocate and free without pause while the main thread forks: no child may inherit a
 * lock held by a thread that does not exist in it (each child allocates, frees and exits through
 * the shim's exit handler within 10 s, or SIGALRM kills it). */
static volatile int g_stop;
static void *churn(void *arg) {
    (void)arg; CUdeviceptr p;
    cuCtxSetCurrent(g_ctx);
    while (!g_stop) if (cuMemAlloc_v2(&p, g_chunk) == 0) cuMemFree_v2(p);
    return 0;
}
static int mode_forkstorm(size_t limit) {
    CUdevice dev;
    EXPECT(cuInit(0), 0);
    EXPECT(cuDeviceGet(&dev, 0), 0);
    EXPECT(cuCtxCreate_v2(&g_ctx, 0, dev), 0);
    g_chunk = limit / 64;
    pthread_t t[4];
    for (int i = 0; i < 4; i++) pthread_create(&t[i], 0, churn, 0);
    for (int i = 0; i < 40; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            alarm(10);
            CUdeviceptr p;
            cuCtxSetCurrent(g_ctx);
            CUresult r = cuMemAlloc_v2(&p, g_chunk);
            if (r == 0) cuMemFree_v2(p);
            exit(r == 0 || r == OOM ? 0 : 3);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child %d: status %#x (a deadlock ends in SIGALRM)", i, st);
        usleep(2000);
    }
    g_stop = 1;
    for (int i = 0; i < 4; i++) pthread_join(t[i], 0);
    size_t f = 0, tot = 0;
    EXPECT(cuMemGetInfo_v2(&f, &tot), 0);
    CHECK(f == limit, "after the storm: free %zu of %zu", f, limit);
    return done();
}

/* Print what cuMemGetInfo and cuDeviceTotalMem report. */
static int mode_info(void) {
    setup();
    size_t f = 0, t = 0, tm = 0;
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    EXPECT(cuDeviceTotalMem_v2(&tm, 0), 0);
    printf("total=%zu free=%zu totalmem=%zu\n", t, f, tm);
    return done();
}

/* A long-running job that loaded the shim once (the e2e's upgrade: the host's libvgpu.so is
 * replaced under it): holds HELD bytes, then every two seconds prints what cuMemGetInfo says and
 * whether one byte more than the rest of its limit LIMIT is refused, until killed. */
static int mode_steady(size_t limit, size_t held) {
    setup();
    CUdeviceptr keep = 0;
    EXPECT(cuMemAlloc_v2(&keep, held), 0);
    for (unsigned long n = 1;; n++) {
        size_t f = 0, t = 0;
        CUdeviceptr p = 0;
        CUresult info = cuMemGetInfo_v2(&f, &t);
        CUresult over = cuMemAlloc_v2(&p, limit - held + 1);
        if (over == 0) cuMemFree_v2(p);
        printf("STEADY n=%lu info=%d total=%zu free=%zu over=%s\n", n, info, t, f,
               over == OOM ? "refused" : "ALLOWED");
        fflush(stdout);
        sleep(2);
    }
    return 0;
}

/* Launch BLOCKS-block kernels in a loop for SECONDS through PATH: kernel (cuLaunchKernel, the
 * default), launch (cuLaunch: one block), grid (cuLaunchGrid), gridasync (cuLaunchGridAsync),
 * multidevice (cuLaunchCooperativeKernelMultiDevice, one entry on a created stream),
 * multidevice-other (the same on a stream of device 1 while device 0's context is current) or graph
 * (cuGraphLaunch of an executable graph: FAKE_CUDA_SM_COUNT blocks). */
static int mode_busy(double seconds, unsigned blocks, const char *path) {
    setup();
    void *stream = 0, *graph = 0, *node = 0, *exec = 0;
    if (!strcmp(path, "multidevice-other")) {
        /* The stream on device 1, the current context on device 0. */
        CUcontext c0 = 0, c1 = 0;
        CUdevice d1;
        if (cuCtxGetCurrent(&c0) != 0 || cuDeviceGet(&d1, 1) != 0 || cuCtxCreate_v2(&c1, 0, d1) != 0 ||
            cuStreamCreate(&stream, 0) != 0 || cuCtxSetCurrent(c0) != 0) return 1;
        path = "multidevice";
    } else if (cuStreamCreate(&stream, 0) != 0) return 1;
    if (!strcmp(path, "graph") && (cuGraphCreate(&graph, 0) != 0 || cuGraphAddEmptyNode(&node, graph, 0, 0) != 0 ||
                                   cuGraphInstantiateWithFlags(&exec, graph, 0) != 0)) return 1;
    CUDA_LAUNCH_PARAMS lp = { (void *)1, blocks, 1, 1, 128, 1, 1, 0, stream, 0 };
    double end = now_s() + seconds;
    long n = 0;
    while (now_s() < end) {
        CUresult r;
        if (!strcmp(path, "launch")) r = cuLaunch((void *)1);
        else if (!strcmp(path, "grid")) r = cuLaunchGrid((void *)1, (int)blocks, 1);
        else if (!strcmp(path, "gridasync")) r = cuLaunchGridAsync((void *)1, (int)blocks, 1, stream);
        else if (!strcmp(path, "multidevice")) r = cuLaunchCooperativeKernelMultiDevice(&lp, 1, 0);
        else if (!strcmp(path, "graph")) r = cuGraphLaunch(exec, 0);
        else r = cuLaunchKernel((void *)1, blocks, 1, 1, 128, 1, 1, 0, 0, 0, 0);
        if (r != 0) { printf("FAIL: %s launch returned %d\n", path, r); return 1; }
        n++;
    }
    cuCtxSynchronize();
    printf("launched %ld\n", n);
    return 0;
}

/* Graph memory nodes against LIMIT (the fake card: FAKE_CUDA_MEMORY_MIB). The fake maps a
 * graph's allocations at launch, frees what free nodes free, and keeps freed graph memory cached
 * until cuDeviceGraphMemTrim. USED is what the simulated GPU holds for this process. */
typedef unsigned long long (*DeviceUsed)(int);
static DeviceUsed device_used;
static void expect_free(size_t want, int line);

static void *alloc_graph(size_t bytes, int with_free, CUdeviceptr *dptr) {
    void *g = 0, *a = 0, *f = 0;
    EXPECT(cuGraphCreate(&g, 0), 0);
    CUDA_MEM_ALLOC_NODE_PARAMS p; memset(&p, 0, sizeof p);
    p.allocType = 1; p.locType = 1; p.locId = 0; p.bytesize = bytes;
    EXPECT(cuGraphAddMemAllocNode(&a, g, 0, 0, &p), 0);
    if (dptr) *dptr = p.dptr;
    if (with_free) EXPECT(cuGraphAddMemFreeNode(&f, g, &a, 1, p.dptr), 0);
    return g;
}

static int mode_graphmem(size_t limit) {
    setup();
    const size_t half = limit / 2, rest = limit - limit / 2;
    device_used = (DeviceUsed)dlsym(RTLD_DEFAULT, "fake_cuda_device_used");
    CHECK(device_used != 0, "fake_cuda_device_used");
    if (!device_used) return done();
    void *e = 0, *e2 = 0;
    CUdeviceptr p = 0, d = 0;

    /* 1. A graph whose allocation node is larger than the limit is refused at instantiation, by
     *    every instantiation entry point and through cuGetProcAddress; nothing reaches the card. */
    void *big = alloc_graph(limit + 1, 1, 0);
    EXPECT(cuGraphInstantiateWithFlags(&e, big, 0), OOM);
    EXPECT(cuGraphInstantiate(&e, big, 0, 0, 0), OOM);
    EXPECT(cuGraphInstantiate_v2(&e, big, 0, 0, 0), OOM);
    CUDA_GRAPH_INSTANTIATE_PARAMS ip; memset(&ip, 0, sizeof ip);
    EXPECT(cuGraphInstantiateWithParams(&e, big, &ip), OOM);
    GetProc2 gpa = (GetProc2)dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
    struct { const char *name; int version; unsigned long long flags; const char *sym; } via[] = {
        { "cuGraphInstantiate", 12000, 0, "cuGraphInstantiateWithFlags" },
        { "cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2" },
        { "cuGraphInstantiateWithFlags", 12000, 0, "cuGraphInstantiateWithFlags" },
        { "cuGraphInstantiateWithParams", 12000, 2, "cuGraphInstantiateWithParams_ptsz" },
        { "cuGraphExecDestroy", 12000, 0, "cuGraphExecDestroy" },
        { "cuDeviceGraphMemTrim", 12000, 0, "cuDeviceGraphMemTrim" },
        { "cuLaunchGrid", 12000, 0, "cuLaunchGrid" },
        { "cuLaunchGridAsync", 12000, 0, "cuLaunchGridAsync" },
        { "cuLaunch", 12000, 0, "cuLaunch" },
        { "cuLaunchCooperativeKernelMultiDevice", 12000, 0, "cuLaunchCooperativeKernelMultiDevice" },
    };
    for (unsigned i = 0; gpa && i < sizeof via / sizeof via[0]; i++) {
        void *fn = 0; int st = -1; Dl_info info;
        EXPECT(gpa(via[i].name, &fn, via[i].version, via[i].flags, &st), 0);
        CHECK(fn && dladdr(fn, &info) && info.dli_sname && strstr(info.dli_fname, "libvgpu") && !strcmp(info.dli_sname, via[i].sym),
              "%s@%d flags %llu is not the shim's %s", via[i].name, via[i].version, via[i].flags, via[i].sym);
    }
    void *fn = 0; int st = 0;
    if (gpa) EXPECT(gpa("cuGraphInstantiate", &fn, 12000, 0, &st), 0);
    if (fn) EXPECT(((CUresult (*)(void **, void *, unsigned long long))fn)(&e, big, 0), OOM);
    if (gpa) EXPECT(gpa("cuGraphInstantiateWithParams", &fn, 12000, 2, &st), 0);
    if (fn) EXPECT(((CUresult (*)(void **, void *, CUDA_GRAPH_INSTANTIATE_PARAMS *))fn)(&e, big, &ip), OOM);
    EXPECT(cuGraphDestroy(big), 0);
    expect_free(limit, __LINE__);
    CHECK(device_used(0) == 0, "refused graphs put %llu bytes on the card", device_used(0));

    /* 2. A graph's memory counts from its instantiation: what is left for the rest is the
     *    limit less the graph's allocation; a graph that does not fit beside other memory is
     *    refused too. In-graph alloc + free: after the executable graph is destroyed, the memory
     *    the driver keeps cached for graphs stays charged until cuDeviceGraphMemTrim. */
    void *g = alloc_graph(half, 1, 0);
    EXPECT(cuMemAlloc_v2(&p, rest + 1), 0);
    EXPECT(cuGraphInstantiateWithFlags(&e, g, 0), OOM);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuGraphInstantiateWithFlags(&e, g, 0), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, rest + 1), OOM);
    EXPECT(cuMemAlloc_v2(&p, rest), 0);
    EXPECT(cuGraphLaunch(e, 0), 0);
    EXPECT(cuCtxSynchronize(), 0);
    CHECK(device_used(0) <= limit, "graph launch: the card holds %llu of a %zu limit", device_used(0), limit);
    EXPECT(cuGraphLaunch(e, 0), 0);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuGraphExecDestroy(e), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, rest + 1), OOM);
    EXPECT(cuDeviceGraphMemTrim(0), 0);
    expect_free(limit, __LINE__);
    /* Instantiated again, the same graph counts again. */
    EXPECT(cuGraphInstantiateWithFlags(&e, g, 0), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuGraphExecDestroy(e), 0);
    expect_free(limit, __LINE__);
    EXPECT(cuGraphDestroy(g), 0);

    /* 3. An allocation no free node frees outlives the launch and the executable graph: charged
     *    until the program frees it (cuMemFreeAsync), then the cached memory until a trim. */
    g = alloc_graph(half, 0, &d);
    EXPECT(cuGraphInstantiateWithFlags(&e, g, 0), 0);
    EXPECT(cuGraphLaunch(e, 0), 0);
    EXPECT(cuGraphExecDestroy(e), 0);
    EXPECT(cuGraphDestroy(g), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, rest + 1), OOM);
    EXPECT(cuMemFreeAsync(d, 0), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuDeviceGraphMemTrim(0), 0);
    expect_free(limit, __LINE__);

    /* 4. Freed without a launch in between, an executable graph's charge stays while it exists;
     *    two graphs that each fit but not together: the second is refused. */
    void *g1 = alloc_graph(half, 1, 0), *g2 = alloc_graph(rest + 1, 1, 0);
    EXPECT(cuGraphInstantiateWithFlags(&e, g1, 0), 0);
    EXPECT(cuGraphInstantiateWithFlags(&e2, g2, 0), OOM);
    EXPECT(cuGraphExecDestroy(e), 0);
    EXPECT(cuGraphInstantiateWithFlags(&e2, g2, 0), 0);
    EXPECT(cuGraphLaunch(e2, 0), 0);
    CHECK(device_used(0) <= limit, "second graph: the card holds %llu of a %zu limit", device_used(0), limit);
    EXPECT(cuGraphExecDestroy(e2), 0);
    EXPECT(cuDeviceGraphMemTrim(0), 0);
    EXPECT(cuGraphDestroy(g1), 0);
    EXPECT(cuGraphDestroy(g2), 0);
    expect_free(limit, __LINE__);
    CHECK(device_used(0) == 0, "at the end the card holds %llu", device_used(0));
    return done();
}

/* Module loads and memory pools against LIMIT (the fake driver's modules take the bytes their
 * image names). Holds a 16 MiB module and 32 MiB of retained pool memory at the checkpoint:
 * writes READY, waits for GO, then checks that everything is given back. */
static const char *module_image(size_t bytes) {
    static char buf[8][64]; static int n = 0;
    char *b = buf[n++ % 8];
    snprintf(b, 64, "fake-module:%zu", bytes);
    return b;
}

static void expect_free(size_t want, int line) {
    size_t free_b = 0, total = 0;
    EXPECT(cuMemGetInfo_v2(&free_b, &total), 0);
    CHECK(free_b == want, "line %d: cuMemGetInfo free %zu, expected %zu", line, free_b, want);
}

static int mode_modpool(size_t limit, const char *ready, const char *go) {
    setup();
    const size_t M = 1 << 20, mod = 16 * M, rest = limit - mod;
    void *m1 = 0, *m2 = (void *)1, *m3 = 0, *lib = 0, *m4 = (void *)1;
    CUdeviceptr p = 0, a = 0, b = 0;

    /* A module's device memory counts: what is left for data is limit - 16 MiB. */
    EXPECT(cuModuleLoadData(&m1, module_image(mod)), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, rest + 1), OOM);
    EXPECT(cuMemAlloc_v2(&p, rest), 0);
    EXPECT(cuMemFree_v2(p), 0);
    /* A module larger than what is left is refused, unloaded, and its handle cleared. */
    EXPECT(cuModuleLoadData(&m2, module_image(limit)), OOM);
    CHECK(m2 == 0, "refused module handle %p", m2);
    EXPECT(cuModuleLoadDataEx(&m4, module_image(rest + M), 0, 0, 0), OOM);
    EXPECT(cuModuleLoadFatBinary(&m4, module_image(rest + M)), OOM);
    expect_free(rest, __LINE__);
    /* From a file; libraries (CUDA 12) too; unloading gives the memory back. */
    char path[] = "/tmp/tessera-module-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    const char *img = module_image(8 * M);
    CHECK(write(fd, img, strlen(img)) == (ssize_t)strlen(img), "write");
    close(fd);
    EXPECT(cuModuleLoad(&m3, path), 0);
    expect_free(rest - 8 * M, __LINE__);
    EXPECT(cuModuleUnload(m3), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuLibraryLoadFromFile(&lib, path, 0, 0, 0, 0, 0, 0), 0);
    expect_free(rest - 8 * M, __LINE__);
    EXPECT(cuLibraryUnload(lib), 0);
    unlink(path);
    EXPECT(cuLibraryLoadData(&lib, module_image(rest + 1), 0, 0, 0, 0, 0, 0), OOM);
    EXPECT(cuLibraryLoadData(&lib, module_image(rest), 0, 0, 0, 0, 0, 0), 0);
    EXPECT(cuMemAlloc_v2(&p, 1), OOM);
    EXPECT(cuLibraryUnload(lib), 0);
    expect_free(rest, __LINE__);

    /* The default pool (release threshold 0): allocations count, frees give back at once. */
    void *dpool = 0;
    EXPECT(cuDeviceGetMemPool(&dpool, 0), 0);
    EXPECT(cuMemAllocAsync(&a, rest - 8 * M, 0), 0);
    EXPECT(cuMemAllocAsync(&b, 8 * M + 1, 0), OOM);
    EXPECT(cuMemFreeAsync(a, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    EXPECT(cuMemAlloc_v2(&p, rest), 0);
    EXPECT(cuMemFree_v2(p), 0);

    /* A pool that keeps what is freed (threshold "everything"): the kept memory stays charged. */
    CUmemPoolProps props; memset(&props, 0, sizeof props);
    props.allocType = 1; props.locType = 1; props.locId = 0;
    void *pool = 0;
    unsigned long long keep_all = ~0ULL, zero = 0;
    EXPECT(cuMemPoolCreate(&pool, &props), 0);
    EXPECT(cuMemPoolSetAttribute(pool, 4, &keep_all), 0);
    EXPECT(cuMemAllocFromPoolAsync(&a, 32 * M, pool, 0), 0);
    EXPECT(cuMemFreeAsync(a, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    unsigned long long reserved = 0;
    EXPECT(cuMemPoolGetAttribute(pool, 5, &reserved), 0);
    CHECK(reserved == 32 * M, "pool reserves %llu", reserved);
    expect_free(rest - 32 * M, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, rest - 32 * M + 1), OOM);
    EXPECT(cuMemAlloc_v2(&p, rest - 32 * M), 0);
    EXPECT(cuMemFree_v2(p), 0);
    /* The pool's own allocations reuse what it keeps (no double charge); beyond it, OOM. */
    EXPECT(cuMemAllocFromPoolAsync(&a, 32 * M, pool, 0), 0);
    EXPECT(cuMemAllocFromPoolAsync(&b, rest - 32 * M + 1, pool, 0), OOM);
    EXPECT(cuMemAllocFromPoolAsync(&b, rest - 32 * M, pool, 0), 0);
    EXPECT(cuMemFreeAsync(b, 0), 0);
    EXPECT(cuMemFreeAsync(a, 0), 0);
    expect_free(0, __LINE__);

    /* Checkpoint: the monitor sees 16 MiB of module and `rest` of pool memory. */
    FILE *f = fopen(ready, "w");
    if (f) { fputs("ready\n", f); fclose(f); }
    for (int i = 0; i < 30000 && access(go, F_OK) != 0; i++) usleep(1000);

    /* Trimming gives the kept memory back. */
    EXPECT(cuMemPoolTrimTo(pool, 0), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, rest), 0);
    EXPECT(cuMemFree_v2(p), 0);
    /* Lowering the threshold: released at the next synchronisation, uncharged at once. */
    EXPECT(cuMemAllocFromPoolAsync(&a, 32 * M, pool, 0), 0);
    EXPECT(cuMemFreeAsync(a, 0), 0);
    expect_free(rest - 32 * M, __LINE__);
    EXPECT(cuMemPoolSetAttribute(pool, 4, &zero), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    expect_free(rest, __LINE__);
    /* Destroying a pool gives back what it kept. */
    EXPECT(cuMemPoolSetAttribute(pool, 4, &keep_all), 0);
    EXPECT(cuMemAllocFromPoolAsync(&a, 32 * M, pool, 0), 0);
    EXPECT(cuMemFreeAsync(a, 0), 0);
    expect_free(rest - 32 * M, __LINE__);
    EXPECT(cuMemPoolDestroy(pool), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, rest), 0);
    EXPECT(cuMemFree_v2(p), 0);
    /* The pool gives its memory back where the shim cannot see it (a synchronisation): the
     * stale charge is re-read from the driver before an allocation would be refused. */
    typedef CUresult (*PoolRelease)(void *);
    PoolRelease behind = (PoolRelease)dlsym(RTLD_DEFAULT, "fake_cuda_pool_release");
    CHECK(behind != 0, "fake_cuda_pool_release");
    EXPECT(cuMemPoolCreate(&pool, &props), 0);
    EXPECT(cuMemPoolSetAttribute(pool, 4, &keep_all), 0);
    EXPECT(cuMemAllocFromPoolAsync(&a, 32 * M, pool, 0), 0);
    EXPECT(cuMemFreeAsync(a, 0), 0);
    if (behind) EXPECT(behind(pool), 0);
    expect_free(rest - 32 * M, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, rest), 0);
    EXPECT(cuMemFree_v2(p), 0);
    expect_free(rest, __LINE__);
    EXPECT(cuMemPoolDestroy(pool), 0);

    /* Through cuGetProcAddress_v2 (cudart's path) the module and pool calls are the shim's. */
    typedef CUresult (*GetProc2)(const char *, void **, int, unsigned long long, int *);
    GetProc2 gpa = (GetProc2)dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
    const char *wrapped[] = { "cuModuleLoadData", "cuModuleUnload", "cuLibraryLoadData", "cuMemPoolTrimTo", 0 };
    for (int i = 0; gpa && wrapped[i]; i++) {
        void *fn = 0; int st = -1; Dl_info info;
        EXPECT(gpa(wrapped[i], &fn, 12080, 0, &st), 0);
        CHECK(fn && dladdr(fn, &info) && strstr(info.dli_fname, "libvgpu"), "%s via cuGetProcAddress_v2 is not the shim's", wrapped[i]);
    }
    typedef CUresult (*LoadData)(void **, const void *);
    LoadData load = 0; int st = 0;
    if (gpa) EXPECT(gpa("cuModuleLoadData", (void **)&load, 12080, 0, &st), 0);
    if (load) EXPECT(load(&m2, module_image(rest + 1)), OOM);

    EXPECT(cuModuleUnload(m1), 0);
    expect_free(limit, __LINE__);
    return done();
}

/* A module load during which another thread allocates 8 MiB and frees 4 MiB (counted): the
 * module is charged only its own 16 MiB (the fake's load takes FAKE_CUDA_MODULE_LOAD_MS). */
static CUcontext race_ctx;
static CUdeviceptr race_new, race_old;
static void *race_thread(void *arg) {
    (void)arg;
    usleep(50000);
    EXPECT(cuCtxSetCurrent(race_ctx), 0);
    EXPECT(cuMemAlloc_v2(&race_new, 8 << 20), 0);
    EXPECT(cuMemFree_v2(race_old), 0);
    return 0;
}

static int mode_modrace(size_t limit) {
    setup();
    const size_t M = 1 << 20;
    EXPECT(cuCtxGetCurrent(&race_ctx), 0);
    EXPECT(cuMemAlloc_v2(&race_old, 4 * M), 0);
    pthread_t t;
    pthread_create(&t, 0, race_thread, 0);
    void *m = 0;
    EXPECT(cuModuleLoadData(&m, module_image(16 * M)), 0);
    pthread_join(t, 0);
    expect_free(limit - 24 * M, __LINE__);
    EXPECT(cuMemFree_v2(race_new), 0);
    expect_free(limit - 16 * M, __LINE__);
    EXPECT(cuModuleUnload(m), 0);
    expect_free(limit, __LINE__);
    return done();
}

/* A driver whose cuGetProcAddress answers every requested version of a name with the same entry
 * point (the fake with FAKE_CUDA_PROC_AGNOSTIC=1): cuMemGetInfo, cuMemAlloc and cuMemFree asked
 * for at version 12000 must be the shim's v2 (64-bit) wrappers, whatever was asked before. ORDER:
 *   probe-first   a per-thread cuLaunchKernel lookup first: with internal entry points it made the
 *                 shim probe the driver's table before the v2 lookups (the order that broke)
 *   legacy-first  the three names at version 3010 first (they must be the legacy wrappers)
 *   direct        the v2 lookups first */
static int mode_agnostic(size_t limit, const char *order) {
    GetProc2 gpa = (GetProc2)dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
    CHECK(gpa, "cuGetProcAddress_v2 missing");
    if (!gpa) return done();
    const char *names[] = { "cuMemGetInfo", "cuMemAlloc", "cuMemFree" };
    void *fn[3] = {0};
    Dl_info info;
    int st = -1;
    if (!strcmp(order, "probe-first")) {
        void *l = 0;
        EXPECT(gpa("cuLaunchKernel", &l, 12000, 2, &st), 0);
    } else if (!strcmp(order, "legacy-first")) {
        for (int i = 0; i < 3; i++) {
            void *old = 0;
            EXPECT(gpa(names[i], &old, 3010, 0, &st), 0);
            CHECK(old && dladdr(old, &info) && info.dli_sname && strstr(info.dli_fname, "libvgpu") && !strcmp(info.dli_sname, names[i]),
                  "%s@3010 is %s, not the shim's legacy wrapper", names[i], old && info.dli_sname ? info.dli_sname : "?");
        }
    }
    for (int i = 0; i < 3; i++) {
        EXPECT(gpa(names[i], &fn[i], 12000, 0, &st), 0);
        char want[64];
        snprintf(want, sizeof want, "%s_v2", names[i]);
        CHECK(fn[i] && dladdr(fn[i], &info) && info.dli_sname && strstr(info.dli_fname, "libvgpu") && !strcmp(info.dli_sname, want),
              "%s@12000 (%s) is %s from %s, not the shim's %s", names[i], order,
              fn[i] && info.dli_sname ? info.dli_sname : "?", fn[i] ? info.dli_fname : "?", want);
    }
    if (failures) return done();
    setup();
    CUresult (*meminfo)(size_t *, size_t *) = fn[0];
    CUresult (*alloc)(CUdeviceptr *, size_t) = fn[1];
    CUresult (*freep)(CUdeviceptr) = fn[2];
    size_t f = 0, t = 0;
    CUdeviceptr p = 0, q = 0;
    EXPECT(meminfo(&f, &t), 0);
    CHECK(t == limit && f == limit, "meminfo free %zu total %zu, limit %zu", f, t, limit);
    EXPECT(alloc(&p, limit), 0);
    EXPECT(alloc(&q, 1), OOM);
    EXPECT(freep(p), 0);
    EXPECT(alloc(&p, limit), 0);
    EXPECT(meminfo(&f, &t), 0);
    CHECK(f == 0 && t == limit, "meminfo after a full allocation: free %zu total %zu", f, t);
    EXPECT(freep(p), 0);
    return done();
}

/* Context limits reserve device memory (the fake: stack size x 65536 threads, heap and printf
 * FIFO at their size). Under LIMIT: counted in cuMemGetInfo, a value that does not fit is
 * refused and set back, a smaller value gives memory back, the card never holds more. */
typedef CUresult (*CtxSetLimit)(int, size_t);
typedef CUresult (*CtxGetLimit)(size_t *, int);
static int mode_ctxlimit(size_t limit) {
    setup();
    typedef unsigned long long (*DeviceUsedFn)(int);
    DeviceUsedFn used = (DeviceUsedFn)dlsym(RTLD_DEFAULT, "fake_cuda_device_used");
    CtxSetLimit set = (CtxSetLimit)dlsym(RTLD_DEFAULT, "cuCtxSetLimit");
    CtxGetLimit get = (CtxGetLimit)dlsym(RTLD_DEFAULT, "cuCtxGetLimit");
    CHECK(used && set && get, "driver symbols");
    if (!used || !set || !get) return done();
    Dl_info info;
    CHECK(dladdr((void *)set, &info) && strstr(info.dli_fname, "libvgpu"), "cuCtxSetLimit is the shim's");
    const size_t M = 1 << 20;
    size_t free_b = 0, total = 0, v = 0;
    CUdeviceptr p = 0;
    EXPECT(set(0, 256), 0); /* 16 MiB of stack */
    EXPECT(cuMemGetInfo_v2(&free_b, &total), 0);
    CHECK(free_b == limit - 16 * M, "free after a 16 MiB stack: %zu", free_b);
    EXPECT(cuMemAlloc_v2(&p, limit - 16 * M), 0);
    EXPECT(cuMemAlloc_v2(&p, 1), OOM);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(set(0, limit / 65536), 0); /* the whole limit */
    EXPECT(cuMemAlloc_v2(&p, 1), OOM);
    EXPECT(set(0, 2 * limit / 65536), OOM); /* twice the limit: refused, set back */
    EXPECT(get(&v, 0), 0);
    CHECK(v == limit / 65536, "the stack size set back: %zu", v);
    CHECK(used(0) == limit, "the card holds the limit's worth: %llu", used(0));
    EXPECT(set(0, 0), 0); /* gives it back */
    EXPECT(cuMemGetInfo_v2(&free_b, &total), 0);
    CHECK(free_b == limit, "free after the stack is given back: %zu", free_b);
    EXPECT(set(2, limit + 1), OOM); /* a malloc heap larger than the limit */
    CHECK(used(0) == 0, "nothing held: %llu", used(0));
    EXPECT(set(2, 8 * M), 0);
    EXPECT(cuMemAlloc_v2(&p, limit - 8 * M + 1), OOM);
    EXPECT(cuMemAlloc_v2(&p, limit - 8 * M), 0);
    EXPECT(cuMemFree_v2(p), 0);
    return done();
}

/* Opt-in oversubscription: LIMIT bytes booked, SHARE of them on the device (the limits file's
 * TESSERA_DEVICE_MEMORY_SHARE_0). cuMemAlloc past the share is served from mapped host memory
 * (the card's usage does not grow), every other path stops at the share, the whole booking
 * stops everything, frees (plain and stream-ordered) give host memory back. With READY/GO
 * files, holds SHARE on the device and LIMIT - SHARE on the host between them. */
static int mode_oversub(size_t limit, size_t share, const char *ready, const char *go) {
    setup();
    typedef unsigned long long (*DeviceUsedFn)(int);
    DeviceUsedFn used = (DeviceUsedFn)dlsym(RTLD_DEFAULT, "fake_cuda_device_used");
    Calls calls = (Calls)dlsym(RTLD_DEFAULT, "fake_cuda_calls");
    CHECK(used && calls, "fake driver symbols");
    if (!used || !calls) return done();
    size_t free_b = 0, total = 0;
    EXPECT(cuMemGetInfo_v2(&free_b, &total), 0);
    CHECK(total == limit && free_b == limit, "memory info before: free %zu total %zu, expected %zu", free_b, total, limit);
    CUdeviceptr dev = 0, host = 0, more = 0;
    EXPECT(cuMemAlloc_v2(&dev, share), 0);
    CHECK(used(0) == share, "the share is on the card: %llu", used(0));
    EXPECT(cuMemAlloc_v2(&host, limit - share), 0);
    CHECK(used(0) == share, "past the share the card holds nothing more: %llu", used(0));
    CHECK(calls("cuMemHostRegister_v2") == 1, "served from host memory (%llu cuMemHostRegister_v2)", calls("cuMemHostRegister_v2"));
    EXPECT(cuMemGetInfo_v2(&free_b, &total), 0);
    CHECK(total == limit && free_b == 0, "memory info when full: free %zu total %zu", free_b, total);
    EXPECT(cuMemAlloc_v2(&more, 1), OOM);
    if (ready) {
        FILE *f = fopen(ready, "w");
        if (f) fclose(f);
        while (access(go, F_OK) != 0) usleep(1000);
    }
    EXPECT(cuMemFree_v2(host), 0);
    CHECK(calls("cuMemHostUnregister") == 1, "host memory given back (%llu cuMemHostUnregister)", calls("cuMemHostUnregister"));
    /* Other paths are held to the share, not the booking: the device is full. */
    EXPECT(cuMemAllocAsync(&more, 1 << 20, 0), OOM);
    unsigned long long h = 0;
    CUmemAllocationProp prop = { .type = 1, .locType = 1, .locId = 0 };
    EXPECT(cuMemCreate(&h, 2 << 20, &prop, 0), OOM);
    /* A stream-ordered free of host-backed memory waits for the stream and gives it back. */
    EXPECT(cuMemAlloc_v2(&host, limit - share), 0);
    EXPECT(cuMemFreeAsync(host, 0), 0);
    CHECK(calls("cuMemHostUnregister") == 2, "stream-ordered free (%llu cuMemHostUnregister)", calls("cuMemHostUnregister"));
    EXPECT(cuMemFree_v2(dev), 0);
    CHECK(used(0) == 0, "all freed, the card holds %llu", used(0));
    /* The share is device memory again for every path. */
    EXPECT(cuMemAllocAsync(&more, share, 0), 0);
    EXPECT(cuMemFreeAsync(more, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    return done();
}

/* ---- LLM serving patterns (tests/serving.rs): tensor-parallel workers, vLLM's memory
 * profiling, CUDA graph replay, IPC and VMM sharing between processes, expandable segments,
 * and cuGetProcAddress as CUDA 13's cudart calls it. */
#include <fcntl.h>
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDeviceGetCount(int *);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
typedef struct { int locType, locId; int flags; } CUmemAccessDesc;
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef struct { char reserved[64]; } CUipcMemHandle;
CUresult cuIpcGetMemHandle(CUipcMemHandle *, CUdeviceptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *, CUipcMemHandle, unsigned);
CUresult cuIpcCloseMemHandle(CUdeviceptr);
CUresult cuMemExportToShareableHandle(void *, unsigned long long, int, unsigned long long);
CUresult cuMemImportFromShareableHandle(unsigned long long *, void *, int);

/* Waits (bounded) for PATH to exist; false on timeout. */
static int wait_file(const char *path, double seconds) {
    double end = now_s() + seconds;
    while (access(path, F_OK) != 0) {
        if (now_s() > end) { CHECK(0, "timed out waiting for %s", path); return 0; }
        usleep(500);
    }
    return 1;
}
static void touch(const char *path) { FILE *f = fopen(path, "w"); if (f) fclose(f); }
static const char *in_dir(const char *dir, const char *name) {
    static char buf[8][512]; static int n = 0;
    char *b = buf[n++ % 8];
    snprintf(b, 512, "%s/%s", dir, name);
    return b;
}

/* One vLLM tensor-parallel worker: the primary context of device ORDINAL made current, then
 * (from START on, all workers at once) the device filled to LIMIT in 1 MiB blocks, one byte
 * more refused, READY written while the memory is held, and kernels of 40 blocks launched for
 * SECONDS (paced by CUDA_DEVICE_SM_LIMIT); every launch reaches the driver. */
static int mode_tpworker(int ordinal, size_t limit, double seconds, const char *start, const char *ready) {
    CUdevice dev; CUcontext ctx = 0;
    EXPECT(cuInit(0), 0);
    EXPECT(cuDeviceGet(&dev, ordinal), 0);
    EXPECT(cuDevicePrimaryCtxRetain(&ctx, dev), 0);
    EXPECT(cuCtxSetCurrent(ctx), 0);
    Calls calls = (Calls)dlsym(RTLD_DEFAULT, "fake_cuda_calls");
    CHECK(calls, "fake_cuda_calls");
    if (failures) return done();
    if (!wait_file(start, 30)) return done();
    size_t f = 0, t = 0;
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    CHECK(t == limit && f == limit, "device %d before: free %zu total %zu, limit %zu", ordinal, f, t, limit);
    static CUdeviceptr blocks[4096];
    size_t n = 0, mib = 1 << 20;
    while (n < 4096 && cuMemAlloc_v2(&blocks[n], mib) == 0) n++;
    CHECK(n * mib == limit, "device %d: %zu MiB allocated under a %zu-byte limit", ordinal, n, limit);
    CUdeviceptr q;
    EXPECT(cuMemAlloc_v2(&q, 1), OOM);
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    CHECK(f == 0 && t == limit, "device %d full: free %zu total %zu", ordinal, f, t);
    touch(ready);
    unsigned long long before = calls("cuLaunchKernel");
    long launches = 0;
    double end = now_s() + seconds;
    while (now_s() < end) {
        CUresult r = cuLaunchKernel((void *)1, 40, 1, 1, 128, 1, 1, 0, 0, 0, 0);
        if (r != 0) { CHECK(0, "device %d: launch %ld returned %d", ordinal, launches, r); break; }
        launches++;
    }
    EXPECT(cuCtxSynchronize(), 0);
    CHECK(launches > 0 && calls("cuLaunchKernel") == before + launches, "device %d: %ld launches, %llu reached the driver",
          ordinal, launches, calls("cuLaunchKernel") - before);
    for (size_t i = 0; i < n; i++) EXPECT(cuMemFree_v2(blocks[i]), 0);
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    CHECK(f == limit, "device %d after: free %zu of %zu", ordinal, f, limit);
    printf("device %d: %ld launches\n", ordinal, launches);
    return done();
}

/* The driver / NCCL initialisation pattern: one process touches each of the N devices in turn
 * (primary context, memory info, a small buffer, a kernel), then fills each device to its own
 * limit (LIMITS[d]): one byte past it is refused on that device only, the devices not yet
 * filled keep their whole free memory. */
static int mode_tpinit(int n, char **limits) {
    EXPECT(cuInit(0), 0);
    const size_t mib = 1 << 20;
    CUcontext ctx[16] = {0};
    CUdeviceptr small[16] = {0}, big[16] = {0}, q;
    size_t lim[16], f = 0, t = 0, tm = 0;
    Calls calls = (Calls)dlsym(RTLD_DEFAULT, "fake_cuda_calls");
    CHECK(calls && n > 0 && n <= 16, "fake_cuda_calls, device count %d", n);
    if (failures) return done();
    int count = 0;
    EXPECT(cuDeviceGetCount(&count), 0);
    CHECK(count == n, "%d devices, expected %d", count, n);
    for (int d = 0; d < n; d++) {
        lim[d] = strtoull(limits[d], 0, 10);
        CUdevice dev;
        EXPECT(cuDeviceGet(&dev, d), 0);
        EXPECT(cuDevicePrimaryCtxRetain(&ctx[d], dev), 0);
        EXPECT(cuCtxSetCurrent(ctx[d]), 0);
        EXPECT(cuMemGetInfo_v2(&f, &t), 0);
        CHECK(t == lim[d] && f == lim[d], "device %d: free %zu total %zu, limit %zu", d, f, t, lim[d]);
        EXPECT(cuDeviceTotalMem_v2(&tm, dev), 0);
        CHECK(tm == lim[d], "device %d: cuDeviceTotalMem %zu, limit %zu", d, tm, lim[d]);
        EXPECT(cuMemAlloc_v2(&small[d], mib), 0);
        unsigned long long before = calls("cuLaunchKernel");
        EXPECT(cuLaunchKernel((void *)1, 40, 1, 1, 128, 1, 1, 0, 0, 0, 0), 0);
        EXPECT(cuCtxSynchronize(), 0);
        CHECK(calls("cuLaunchKernel") == before + 1, "device %d: the launch did not reach the driver", d);
    }
    for (int d = 0; d < n; d++) {
        EXPECT(cuCtxSetCurrent(ctx[d]), 0);
        EXPECT(cuMemAlloc_v2(&big[d], lim[d] - mib), 0);
        EXPECT(cuMemAlloc_v2(&q, 1), OOM);
        EXPECT(cuMemGetInfo_v2(&f, &t), 0);
        CHECK(f == 0 && t == lim[d], "device %d full: free %zu total %zu", d, f, t);
        for (int e = d + 1; e < n; e++) {
            EXPECT(cuCtxSetCurrent(ctx[e]), 0);
            EXPECT(cuMemGetInfo_v2(&f, &t), 0);
            CHECK(f == lim[e] - mib, "device %d full, device %d: free %zu, expected %zu", d, e, f, lim[e] - mib);
            EXPECT(cuLaunchKernel((void *)1, 40, 1, 1, 128, 1, 1, 0, 0, 0, 0), 0);
        }
    }
    for (int d = 0; d < n; d++) {
        EXPECT(cuCtxSetCurrent(ctx[d]), 0);
        EXPECT(cuMemFree_v2(big[d]), 0);
        EXPECT(cuMemFree_v2(small[d]), 0);
        EXPECT(cuMemGetInfo_v2(&f, &t), 0);
        CHECK(f == lim[d], "device %d freed: free %zu of %zu", d, f, lim[d]);
    }
    return done();
}

/* Allocates BYTES, writes READY, holds them until GO, frees and exits (another process of the
 * container, allocating while a profiler measures). */
static int mode_allochold(size_t bytes, const char *ready, const char *go) {
    setup();
    CUdeviceptr p = 0;
    EXPECT(cuMemAlloc_v2(&p, bytes), 0);
    touch(ready);
    wait_file(go, 30);
    EXPECT(cuMemFree_v2(p), 0);
    return done();
}

/* vLLM's memory profiling (determine_available_memory): cuMemGetInfo before and after a
 * warm-up allocation of WARM bytes (cuMemAlloc and stream-ordered halves) reports free memory
 * lower by exactly WARM and total = the limit; while another process of the container holds
 * OTHER bytes (the test starts it between DIR/a1 and DIR/b), free is lower by OTHER too and
 * exactly what is left is allocatable; when it has exited (DIR/bgone), its share is back. */
static int mode_memprofile(size_t limit, size_t warm, size_t other, const char *dir) {
    setup();
    size_t f0 = 0, t0 = 0, f = 0, t = 0;
    EXPECT(cuMemGetInfo_v2(&f0, &t0), 0);
    CHECK(t0 == limit && f0 == limit, "before: free %zu total %zu, limit %zu", f0, t0, limit);
    CUdeviceptr a = 0, b = 0, q = 0;
    EXPECT(cuMemAlloc_v2(&a, warm / 2), 0);
    EXPECT(cuMemAllocAsync(&b, warm - warm / 2, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    CHECK(t == limit && f == f0 - warm, "after the warm-up: free %zu (dropped by %zu, allocated %zu) total %zu",
          f, f0 - f, warm, t);
    touch(in_dir(dir, "a1"));
    if (!wait_file(in_dir(dir, "b"), 30)) return done();
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    CHECK(t == limit && f == f0 - warm - other, "with the other process: free %zu, expected %zu", f, f0 - warm - other);
    /* vLLM sizes its KV cache from free: exactly that much fits, one byte more does not. */
    EXPECT(cuMemAlloc_v2(&q, f + 1), OOM);
    EXPECT(cuMemAlloc_v2(&q, f), 0);
    EXPECT(cuMemFree_v2(q), 0);
    touch(in_dir(dir, "a2"));
    if (!wait_file(in_dir(dir, "bgone"), 30)) return done();
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    CHECK(f == f0 - warm, "the other process exited: free %zu, expected %zu", f, f0 - warm);
    EXPECT(cuMemFree_v2(a), 0);
    EXPECT(cuMemFreeAsync(b, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    CHECK(f == limit, "all freed: free %zu of %zu", f, limit);
    return done();
}

/* CUDA graph replay: two executable graphs, one with an in-graph workspace (alloc + free node,
 * half the limit) and one whose output outlives each launch (a quarter, freed by the program
 * after each replay), replayed 300 times on a stream: the count never grows, the card never
 * holds more than the half the driver caches for graphs, and what is left stays allocatable to
 * the byte. */
static int mode_graphreplay(size_t limit) {
    setup();
    device_used = (DeviceUsed)dlsym(RTLD_DEFAULT, "fake_cuda_device_used");
    CHECK(device_used != 0, "fake_cuda_device_used");
    if (!device_used) return done();
    const size_t half = limit / 2, quarter = limit / 4, left = limit - half - quarter;
    void *stream = 0, *e1 = 0, *e2 = 0;
    CUdeviceptr out = 0, p = 0;
    EXPECT(cuStreamCreate(&stream, 0), 0);
    void *g1 = alloc_graph(half, 1, 0), *g2 = alloc_graph(quarter, 0, &out);
    EXPECT(cuGraphInstantiateWithFlags(&e1, g1, 0), 0);
    EXPECT(cuGraphInstantiateWithFlags(&e2, g2, 0), 0);
    expect_free(left, __LINE__);
    for (int i = 0; i < 300; i++) {
        EXPECT(cuGraphLaunch(e1, stream), 0);
        EXPECT(cuGraphLaunch(e2, stream), 0);
        EXPECT(cuMemFreeAsync(out, stream), 0);
        if (i % 50 == 0 || i == 299) {
            EXPECT(cuStreamSynchronize(stream), 0);
            expect_free(left, __LINE__);
            CHECK(device_used(0) == half, "replay %d: the card holds %llu, expected %zu", i, device_used(0), half);
        }
        if (failures) return done();
    }
    EXPECT(cuMemAlloc_v2(&p, left + 1), OOM);
    EXPECT(cuMemAlloc_v2(&p, left), 0);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuGraphExecDestroy(e1), 0);
    EXPECT(cuGraphExecDestroy(e2), 0);
    /* What the driver keeps cached for graphs stays charged until it is trimmed. */
    expect_free(limit - half, __LINE__);
    EXPECT(cuDeviceGraphMemTrim(0), 0);
    expect_free(limit, __LINE__);
    CHECK(device_used(0) == 0, "after the trim the card holds %llu", device_used(0));
    EXPECT(cuGraphDestroy(g1), 0);
    EXPECT(cuGraphDestroy(g2), 0);
    return done();
}

/* The exporting side of IPC (vLLM's custom all-reduce buffers, PyTorch's CUDA tensors sent to
 * another process): IPC bytes from cuMemAlloc exported with cuIpcGetMemHandle (DIR/ipc), VMM
 * bytes from cuMemCreate exported as a file descriptor (DIR/fd: "pid fd"), DIR/exported
 * written; after DIR/imported (the importer opened, mapped, closed and released everything),
 * its own count is unchanged, then it frees everything. */
static int mode_ipcexport(size_t limit, size_t ipc, size_t vmm, const char *dir) {
    setup();
    CUdeviceptr p = 0, va = 0;
    CUipcMemHandle h; memset(&h, 0, sizeof h);
    EXPECT(cuMemAlloc_v2(&p, ipc), 0);
    EXPECT(cuIpcGetMemHandle(&h, p), 0);
    FILE *fp = fopen(in_dir(dir, "ipc.tmp"), "wb");
    CHECK(fp && fwrite(&h, sizeof h, 1, fp) == 1, "write the IPC handle");
    if (fp) fclose(fp);
    rename(in_dir(dir, "ipc.tmp"), in_dir(dir, "ipc"));
    CUmemAllocationProp prop; memset(&prop, 0, sizeof prop);
    prop.type = 1; prop.handleTypes = 1 /* POSIX fd */; prop.locType = 1; prop.locId = 0;
    unsigned long long vh = 0;
    int fd = -1;
    EXPECT(cuMemCreate(&vh, vmm, &prop, 0), 0);
    EXPECT(cuMemExportToShareableHandle(&fd, vh, 1, 0), 0);
    EXPECT(cuMemAddressReserve(&va, vmm, 0, 0, 0), 0);
    EXPECT(cuMemMap(va, vmm, 0, vh, 0), 0);
    fp = fopen(in_dir(dir, "fd"), "w");
    if (fp) { fprintf(fp, "%d %d\n", (int)getpid(), fd); fclose(fp); }
    expect_free(limit - ipc - vmm, __LINE__);
    touch(in_dir(dir, "exported"));
    if (!wait_file(in_dir(dir, "imported"), 30)) return done();
    /* The importer's close and release took nothing from the exporter's count. */
    expect_free(limit - ipc - vmm, __LINE__);
    CUdeviceptr q;
    EXPECT(cuMemAlloc_v2(&q, limit - ipc - vmm + 1), OOM);
    EXPECT(cuMemUnmap(va, vmm), 0);
    EXPECT(cuMemRelease(vh), 0);
    EXPECT(cuMemAddressFree(va, vmm), 0);
    EXPECT(cuMemFree_v2(p), 0);
    close(fd);
    expect_free(limit, __LINE__);
    return done();
}

/* The importing side: opens the IPC handle and maps the imported VMM handle; neither is counted
 * again (free stays limit − IPC − VMM, and exactly that much is still allocatable), the fake
 * card holds nothing for this process; READY written, GO awaited (the test reads the region);
 * closing, unmapping and releasing uncount nothing; then DIR/imported. */
static int mode_ipcimport(size_t limit, size_t ipc, size_t vmm, const char *dir, const char *ready, const char *go) {
    setup();
    device_used = (DeviceUsed)dlsym(RTLD_DEFAULT, "fake_cuda_device_used");
    CHECK(device_used != 0, "fake_cuda_device_used");
    if (!device_used || !wait_file(in_dir(dir, "exported"), 30)) return done();
    const size_t left = limit - ipc - vmm;
    CUipcMemHandle h; memset(&h, 0, sizeof h);
    FILE *fp = fopen(in_dir(dir, "ipc"), "rb");
    CHECK(fp && fread(&h, sizeof h, 1, fp) == 1, "read the IPC handle");
    if (fp) fclose(fp);
    int pid = 0, fd = -1;
    fp = fopen(in_dir(dir, "fd"), "r");
    CHECK(fp && fscanf(fp, "%d %d", &pid, &fd) == 2, "read the exporter's fd");
    if (fp) fclose(fp);
    if (failures) return done();
    expect_free(left, __LINE__);
    CUdeviceptr ip = 0, va = 0, q = 0;
    EXPECT(cuIpcOpenMemHandle_v2(&ip, h, 1), 0);
    expect_free(left, __LINE__);
    /* The exporter's file descriptor, as pidfd_getfd or SCM_RIGHTS would pass it. */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int mine = open(path, O_RDONLY);
    CHECK(mine >= 0, "open %s", path);
    unsigned long long ih = 0;
    EXPECT(cuMemImportFromShareableHandle(&ih, (void *)(intptr_t)mine, 1), 0);
    EXPECT(cuMemAddressReserve(&va, vmm, 0, 0, 0), 0);
    EXPECT(cuMemMap(va, vmm, 0, ih, 0), 0);
    CUmemAccessDesc acc = { 1, 0, 3 };
    EXPECT(cuMemSetAccess(va, vmm, &acc, 1), 0);
    expect_free(left, __LINE__);
    CHECK(device_used(0) == 0, "opened and mapped: the card holds %llu for the importer", device_used(0));
    EXPECT(cuMemAlloc_v2(&q, left + 1), OOM);
    EXPECT(cuMemAlloc_v2(&q, left), 0);
    EXPECT(cuMemFree_v2(q), 0);
    touch(ready);
    wait_file(go, 30);
    EXPECT(cuIpcCloseMemHandle(ip), 0);
    EXPECT(cuMemUnmap(va, vmm), 0);
    EXPECT(cuMemRelease(ih), 0);
    EXPECT(cuMemAddressFree(va, vmm), 0);
    if (mine >= 0) close(mine);
    expect_free(left, __LINE__);
    EXPECT(cuMemAlloc_v2(&q, left + 1), OOM);
    touch(in_dir(dir, "imported"));
    return done();
}

/* One serving process's allocators together: weights in managed memory, stream-ordered
 * activations, a pool that keeps what is freed (PyTorch's cudaMallocAsync backend), and
 * expandable segments (a large reserved VA range, 2 MiB cuMemCreate chunks mapped until the
 * limit: one chunk more is OOM, so is every other path); shrinking the segment gives memory
 * the pool can take, to the byte; everything given back at the end. */
static int mode_serve(size_t limit) {
    setup();
    device_used = (DeviceUsed)dlsym(RTLD_DEFAULT, "fake_cuda_device_used");
    CHECK(device_used != 0, "fake_cuda_device_used");
    if (!device_used) return done();
    const size_t M = 1 << 20, gran = 2 * M, weights = 8 * M, act = 4 * M, kept = 6 * M;
    CUdeviceptr w = 0, a = 0, x = 0, q = 0, va = 0;
    EXPECT(cuMemAllocManaged(&w, weights, 1), 0);
    EXPECT(cuMemAllocAsync(&a, act, 0), 0);
    CUmemPoolProps props; memset(&props, 0, sizeof props);
    props.allocType = 1; props.locType = 1; props.locId = 0;
    void *pool = 0;
    unsigned long long keep_all = ~0ULL;
    EXPECT(cuMemPoolCreate(&pool, &props), 0);
    EXPECT(cuMemPoolSetAttribute(pool, 4, &keep_all), 0);
    EXPECT(cuMemAllocFromPoolAsync(&x, kept, pool, 0), 0);
    EXPECT(cuMemFreeAsync(x, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    const size_t base = weights + act + kept;
    expect_free(limit - base, __LINE__);
    /* Expandable segments: twice the limit of address space, chunks mapped until OOM. */
    EXPECT(cuMemAddressReserve(&va, 2 * limit, 0, 0, 0), 0);
    CUmemAllocationProp prop; memset(&prop, 0, sizeof prop);
    prop.type = 1; prop.locType = 1; prop.locId = 0;
    CUmemAccessDesc acc = { 1, 0, 3 };
    static unsigned long long chunk[4096];
    size_t n = 0;
    CUresult last = 0;
    while (n < 4096) {
        last = cuMemCreate(&chunk[n], gran, &prop, 0);
        if (last != 0) break;
        EXPECT(cuMemMap(va + n * gran, gran, 0, chunk[n], 0), 0);
        EXPECT(cuMemSetAccess(va + n * gran, gran, &acc, 1), 0);
        n++;
    }
    CHECK(last == OOM, "the chunk past the limit returned %d, not OOM", last);
    CHECK(n * gran == (limit - base) / gran * gran, "%zu chunks of 2 MiB mapped, %zu bytes were left", n, limit - base);
    size_t rest = limit - base - n * gran;
    expect_free(rest, __LINE__);
    EXPECT(cuMemAlloc_v2(&q, rest + 1), OOM);
    EXPECT(cuMemAllocAsync(&q, rest + 1, 0), OOM);
    EXPECT(cuMemAllocManaged(&q, rest + 1, 1), OOM);
    CHECK(device_used(0) <= limit, "the card holds %llu of a %zu limit", device_used(0), limit);
    /* The segment shrinks by two chunks: the pool serves what it kept plus those, exactly. */
    for (int i = 0; i < 2 && n > 0; i++) {
        n--;
        EXPECT(cuMemUnmap(va + n * gran, gran), 0);
        EXPECT(cuMemRelease(chunk[n]), 0);
    }
    expect_free(rest + 2 * gran, __LINE__);
    EXPECT(cuMemAllocFromPoolAsync(&x, kept + rest + 2 * gran + 1, pool, 0), OOM);
    EXPECT(cuMemAllocFromPoolAsync(&x, kept + rest + 2 * gran, pool, 0), 0);
    expect_free(0, __LINE__);
    EXPECT(cuMemFreeAsync(x, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    /* Teardown. */
    while (n > 0) {
        n--;
        EXPECT(cuMemUnmap(va + n * gran, gran), 0);
        EXPECT(cuMemRelease(chunk[n]), 0);
    }
    EXPECT(cuMemAddressFree(va, 2 * limit), 0);
    EXPECT(cuMemPoolDestroy(pool), 0);
    EXPECT(cuMemFreeAsync(a, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    EXPECT(cuMemFree_v2(w), 0);
    expect_free(limit, __LINE__);
    CHECK(device_used(0) == 0, "at the end the card holds %llu", device_used(0));
    return done();
}

/* CUDA 13's cudart: every hooked name asked through cuGetProcAddress_v2 at VERSION with FLAGS
 * is the shim's wrapper of the variant the driver picks (unhooked names stay the driver's), and
 * the memory, launch and graph entry points so obtained enforce the limit. */
static int mode_procall(size_t limit, int version, unsigned long long flags) {
    GetProc2 gpa = (GetProc2)dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
    ResolveName expected = (ResolveName)dlsym(RTLD_DEFAULT, "fake_cuda_resolve_name");
    Calls calls = (Calls)dlsym(RTLD_DEFAULT, "fake_cuda_calls");
    CHECK(gpa && expected && calls, "driver symbols missing");
    if (failures) return done();
    const char *names[] = {
        "cuInit", "cuGetProcAddress", "cuMemAlloc", "cuMemAllocManaged", "cuMemAllocPitch", "cuMemFree",
        "cuArrayCreate", "cuArray3DCreate", "cuMemGetInfo", "cuDeviceTotalMem", "cuMemAllocAsync",
        "cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuMemCreate", "cuMemRelease", "cuArrayDestroy",
        "cuMipmappedArrayCreate", "cuMipmappedArrayDestroy", "cuLaunchKernel", "cuLaunchKernelEx",
        "cuLaunchCooperativeKernel", "cuGraphLaunch", "cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync",
        "cuLaunchCooperativeKernelMultiDevice", "cuGraphInstantiate", "cuGraphInstantiateWithFlags",
        "cuGraphInstantiateWithParams", "cuGraphExecDestroy", "cuDeviceGraphMemTrim", "cuModuleLoad",
        "cuModuleLoadData", "cuModuleLoadDataEx", "cuModuleLoadFatBinary", "cuModuleUnload",
        "cuLibraryLoadData", "cuLibraryLoadFromFile", "cuLibraryUnload", "cuMemPoolTrimTo",
        "cuMemPoolSetAttribute", "cuMemPoolDestroy",
        /* not hooked: must stay the driver's */
        "cuMemMap", "cuMemSetAccess", "cuIpcOpenMemHandle", "cuIpcCloseMemHandle",
        "cuMemImportFromShareableHandle", "cuCtxSynchronize", "cuStreamSynchronize", "cuMemPoolCreate", 0 };
    /* Every cu* symbol libvgpu.so exports (tests/memory.rs checks that list). */
    const char *hooked[] = {
        "cuInit", "cuGetProcAddress", "cuGetProcAddress_v2", "cuMemAlloc", "cuMemAlloc_v2", "cuMemAllocManaged",
        "cuMemAllocPitch", "cuMemAllocPitch_v2", "cuMemFree", "cuMemFree_v2", "cuArrayCreate", "cuArrayCreate_v2",
        "cuArray3DCreate", "cuArray3DCreate_v2", "cuMemGetInfo", "cuMemGetInfo_v2", "cuDeviceTotalMem",
        "cuDeviceTotalMem_v2", "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemAllocFromPoolAsync",
        "cuMemAllocFromPoolAsync_ptsz", "cuMemFreeAsync", "cuMemFreeAsync_ptsz", "cuMemCreate", "cuMemRelease",
        "cuArrayDestroy", "cuMipmappedArrayCreate", "cuMipmappedArrayDestroy", "cuLaunchKernel",
        "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuLaunchCooperativeKernel",
        "cuLaunchCooperativeKernel_ptsz", "cuGraphLaunch", "cuGraphLaunch_ptsz", "cuLaunch", "cuLaunchGrid",
        "cuLaunchGridAsync", "cuLaunchCooperativeKernelMultiDevice", "cuGraphInstantiate", "cuGraphInstantiate_v2",
        "cuGraphInstantiateWithFlags", "cuGraphInstantiateWithParams", "cuGraphInstantiateWithParams_ptsz",
        "cuGraphExecDestroy", "cuDeviceGraphMemTrim", "cuModuleLoad", "cuModuleLoadData", "cuModuleLoadDataEx",
        "cuModuleLoadFatBinary", "cuModuleUnload", "cuLibraryLoadData", "cuLibraryLoadFromFile", "cuLibraryUnload",
        "cuMemPoolTrimTo", "cuMemPoolSetAttribute", "cuMemPoolDestroy", 0 };
    void *fns[64] = {0};
    Dl_info info;
    for (int i = 0; names[i]; i++) {
        int status = -1;
        CUresult r = gpa(names[i], &fns[i], version, flags, &status);
        const char *want = expected(names[i], version, flags);
        CHECK(want, "the fake driver has no %s at %d", names[i], version);
        if (!want) continue;
        CHECK(r == 0 && status == 0 && fns[i], "%s@%d flags %llu: result %d status %d", names[i], version, flags, r, status);
        if (!fns[i]) continue;
        if (!dladdr(fns[i], &info) || !info.dli_sname) {
            CHECK(0, "%s@%d flags %llu: %p is no exported symbol (not wrapped)", names[i], version, flags, fns[i]);
            continue;
        }
        int is_hooked = 0;
        for (int k = 0; hooked[k]; k++) if (!strcmp(hooked[k], want)) is_hooked = 1;
        int in_shim = strstr(info.dli_fname, "libvgpu") != 0;
        CHECK(!strcmp(info.dli_sname, want) && is_hooked == in_shim, "%s@%d flags %llu: got %s from %s, the driver's choice is %s (%s)",
              names[i], version, flags, info.dli_sname, info.dli_fname, want, is_hooked ? "hooked" : "not hooked");
    }
    if (failures) return done();
    /* What cudart 13 would then call. */
    CUresult (*init)(unsigned) = fns[0];
    CUresult (*alloc)(CUdeviceptr *, size_t) = fns[2];
    CUresult (*freep)(CUdeviceptr) = fns[5];
    CUresult (*meminfo)(size_t *, size_t *) = fns[8];
    CUresult (*aalloc)(CUdeviceptr *, size_t, void *) = fns[10];
    CUresult (*afree)(CUdeviceptr, void *) = fns[12];
    CUresult (*create)(unsigned long long *, size_t, const CUmemAllocationProp *, unsigned long long) = fns[13];
    CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **) = fns[18];
    CUresult (*inst)(void **, void *, unsigned long long) = fns[26];
    EXPECT(init(0), 0);
    CUdevice dev; CUcontext ctx;
    EXPECT(cuDeviceGet(&dev, 0), 0);
    EXPECT(cuCtxCreate_v2(&ctx, 0, dev), 0);
    size_t f = 0, t = 0;
    CUdeviceptr p = 0, q = 0;
    EXPECT(meminfo(&f, &t), 0);
    CHECK(f == limit && t == limit, "cuMemGetInfo@%d: free %zu total %zu, limit %zu", version, f, t, limit);
    EXPECT(alloc(&p, limit), 0);
    EXPECT(alloc(&q, 1), OOM);
    EXPECT(aalloc(&q, 1, 0), OOM);
    CUmemAllocationProp prop; memset(&prop, 0, sizeof prop);
    prop.type = 1; prop.locType = 1; prop.locId = 0;
    unsigned long long h = 0;
    EXPECT(create(&h, 2 << 20, &prop, 0), OOM);
    EXPECT(freep(p), 0);
    EXPECT(aalloc(&p, limit, 0), 0);
    EXPECT(alloc(&q, 1), OOM);
    EXPECT(afree(p, 0), 0);
    EXPECT(cuStreamSynchronize(0), 0);
    void *g = alloc_graph(limit + 1, 1, 0), *e = 0;
    EXPECT(version >= 12000 ? inst(&e, g, 0) : OOM, OOM);
    EXPECT(cuGraphDestroy(g), 0);
    const char *lname = expected("cuLaunchKernel", version, flags);
    unsigned long long before = calls(lname);
    EXPECT(launch((void *)1, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0), 0);
    CHECK(calls(lname) == before + 1, "the launch did not reach the driver's %s", lname);
    EXPECT(meminfo(&f, &t), 0);
    CHECK(f == limit, "everything freed: free %zu", f);
    return done();
}
/* CUDA graph capture with the stream-ordered allocator (PyTorch's cudaMallocAsync backend under
 * torch.cuda.graph): on a captured stream a workspace (half the limit) is allocated and freed,
 * an output (a quarter) allocated and left for the program to free; the capture puts nothing on
 * the card. Instantiated, the graph counts both; replayed 300 times, with the output freed
 * after each replay, the count stays; destroyed, the memory the driver caches for graphs stays
 * counted until trimmed. */
CUresult cuStreamBeginCapture_v2(void *, int);
CUresult cuStreamEndCapture(void *, void **);
CUresult cuStreamIsCapturing(void *, int *);
static int mode_graphcapture(size_t limit) {
    setup();
    device_used = (DeviceUsed)dlsym(RTLD_DEFAULT, "fake_cuda_device_used");
    CHECK(device_used != 0, "fake_cuda_device_used");
    if (!device_used) return done();
    const size_t half = limit / 2, quarter = limit / 4, left = limit - half - quarter;
    void *stream = 0, *g = 0, *e = 0;
    CUdeviceptr ws = 0, out = 0, p = 0;
    int st = -1;
    size_t f = 0, t = 0;
    EXPECT(cuStreamCreate(&stream, 0), 0);
    EXPECT(cuStreamBeginCapture_v2(stream, 0), 0);
    EXPECT(cuStreamIsCapturing(stream, &st), 0);
    CHECK(st == 1, "capture status %d", st);
    EXPECT(cuMemAllocAsync(&ws, half, stream), 0);
    EXPECT(cuMemAllocAsync(&out, quarter, stream), 0);
    EXPECT(cuMemFreeAsync(ws, stream), 0);
    EXPECT(cuStreamEndCapture(stream, &g), 0);
    CHECK(device_used(0) == 0, "the capture put %llu bytes on the card", device_used(0));
    EXPECT(cuMemGetInfo_v2(&f, &t), 0);
    printf("after capture, before instantiation: free %zu of %zu\n", f, t);
    EXPECT(cuGraphInstantiateWithFlags(&e, g, 0), 0);
    expect_free(left, __LINE__);
    EXPECT(cuMemAlloc_v2(&p, left + 1), OOM);
    for (int i = 0; i < 300; i++) {
        EXPECT(cuGraphLaunch(e, stream), 0);
        EXPECT(cuMemFreeAsync(out, stream), 0);
        if (i % 50 == 0 || i == 299) {
            EXPECT(cuStreamSynchronize(stream), 0);
            expect_free(left, __LINE__);
            CHECK(device_used(0) == half + quarter, "replay %d: the card holds %llu", i, device_used(0));
            /* The driver keeps the output's memory for the next replay: past the limit is OOM. */
            CUresult r = cuMemAlloc_v2(&p, left + 1);
            CHECK(r == OOM, "replay %d: %zu bytes allocated beside the graph; the card holds %llu of a %zu limit",
                  i, left + 1, device_used(0), limit);
            if (r == 0) EXPECT(cuMemFree_v2(p), 0);
        }
        if (failures) return done();
    }
    EXPECT(cuMemAlloc_v2(&p, left + 1), OOM);
    EXPECT(cuMemAlloc_v2(&p, left), 0);
    EXPECT(cuMemFree_v2(p), 0);
    EXPECT(cuGraphExecDestroy(e), 0);
    expect_free(left, __LINE__);
    EXPECT(cuDeviceGraphMemTrim(0), 0);
    expect_free(limit, __LINE__);
    CHECK(device_used(0) == 0, "after the trim the card holds %llu", device_used(0));
    EXPECT(cuGraphDestroy(g), 0);
    return done();
}
/* ---- end of the serving patterns */

int main(int argc, char **argv) {
    setvbuf(stdout, 0, _IONBF, 0);
    if (argc >= 3 && !strcmp(argv[1], "limit")) return mode_limit(strtoull(argv[2], 0, 10));
    if (argc >= 3 && !strcmp(argv[1], "modrace")) return mode_modrace(strtoull(argv[2], 0, 10));
    if (argc >= 5 && !strcmp(argv[1], "modpool")) return mode_modpool(strtoull(argv[2], 0, 10), argv[3], argv[4]);
    if (argc >= 5 && !strcmp(argv[1], "procaddr")) return mode_procaddr(strtoull(argv[2], 0, 10), atoi(argv[3]), strtoull(argv[4], 0, 10));
    if (argc >= 4 && !strcmp(argv[1], "agnostic")) return mode_agnostic(strtoull(argv[2], 0, 10), argv[3]);
    if (argc >= 2 && !strcmp(argv[1], "dlsym")) return mode_dlsym();
    if (argc >= 4 && !strcmp(argv[1], "bypass")) return mode_bypass(strtoull(argv[2], 0, 10), argv[3]);
    if (argc >= 5 && !strcmp(argv[1], "hold")) return mode_hold(strtoull(argv[2], 0, 10), argv[3], argv[4]);
    if (argc >= 4 && !strcmp(argv[1], "grab")) return mode_grab(strtoull(argv[2], 0, 10), atof(argv[3]));
    if (argc >= 2 && !strcmp(argv[1], "info")) return mode_info();
    if (argc >= 4 && !strcmp(argv[1], "steady")) return mode_steady(strtoull(argv[2], 0, 10), strtoull(argv[3], 0, 10));
    if (argc >= 3 && !strcmp(argv[1], "threads")) return mode_threads(strtoull(argv[2], 0, 10));
    if (argc >= 3 && !strcmp(argv[1], "fork")) return mode_fork(strtoull(argv[2], 0, 10));
    if (argc >= 3 && !strcmp(argv[1], "nvml")) return mode_nvml(strtoull(argv[2], 0, 10));
    if (argc >= 4 && !strcmp(argv[1], "smi")) return mode_smi(strtoull(argv[2], 0, 10), atof(argv[3]));
    if (argc >= 3 && !strcmp(argv[1], "legacy")) return mode_legacy(strtoull(argv[2], 0, 10));
    if (argc >= 3 && !strcmp(argv[1], "forkexit")) return mode_forkexit(strtoull(argv[2], 0, 10));
    if (argc >= 3 && !strcmp(argv[1], "forkstorm")) return mode_forkstorm(strtoull(argv[2], 0, 10));
    if (argc >= 4 && !strcmp(argv[1], "busy")) return mode_busy(atof(argv[2]), (unsigned)atoi(argv[3]), argc >= 5 ? argv[4] : "kernel");
    if (argc >= 3 && !strcmp(argv[1], "graphmem")) return mode_graphmem(strtoull(argv[2], 0, 10));
    if (argc >= 3 && !strcmp(argv[1], "ctxlimit")) return mode_ctxlimit(strtoull(argv[2], 0, 10));
    if (argc >= 4 && !strcmp(argv[1], "oversub"))
        return mode_oversub(strtoull(argv[2], 0, 10), strtoull(argv[3], 0, 10), argc >= 6 ? argv[4] : 0, argc >= 6 ? argv[5] : 0);
    if (argc >= 7 && !strcmp(argv[1], "tpworker"))
        return mode_tpworker(atoi(argv[2]), strtoull(argv[3], 0, 10), atof(argv[4]), argv[5], argv[6]);
    if (argc >= 3 && !strcmp(argv[1], "tpinit") && argc >= 3 + atoi(argv[2])) return mode_tpinit(atoi(argv[2]), argv + 3);
    if (argc >= 5 && !strcmp(argv[1], "allochold")) return mode_allochold(strtoull(argv[2], 0, 10), argv[3], argv[4]);
    if (argc >= 6 && !strcmp(argv[1], "memprofile"))
        return mode_memprofile(strtoull(argv[2], 0, 10), strtoull(argv[3], 0, 10), strtoull(argv[4], 0, 10), argv[5]);
    if (argc >= 3 && !strcmp(argv[1], "graphreplay")) return mode_graphreplay(strtoull(argv[2], 0, 10));
    if (argc >= 3 && !strcmp(argv[1], "graphcapture")) return mode_graphcapture(strtoull(argv[2], 0, 10));
    if (argc >= 6 && !strcmp(argv[1], "ipcexport"))
        return mode_ipcexport(strtoull(argv[2], 0, 10), strtoull(argv[3], 0, 10), strtoull(argv[4], 0, 10), argv[5]);
    if (argc >= 8 && !strcmp(argv[1], "ipcimport"))
        return mode_ipcimport(strtoull(argv[2], 0, 10), strtoull(argv[3], 0, 10), strtoull(argv[4], 0, 10), argv[5], argv[6], argv[7]);
    if (argc >= 3 && !strcmp(argv[1], "serve")) return mode_serve(strtoull(argv[2], 0, 10));
    if (argc >= 5 && !strcmp(argv[1], "procall")) return mode_procall(strtoull(argv[2], 0, 10), atoi(argv[3]), strtoull(argv[4], 0, 10));
    fprintf(stderr, "usage: cuda_probe limit|procaddr|dlsym|hold|grab|busy ...\n");
    return 2;
}
