/* Per-call cost of driver entry points, with or without libvgpu.so preloaded (the caller
 * decides). Prints "<name> <median ns/call>" for each measured call. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dlfcn.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned);
CUresult cuDeviceGet(int *, int);
CUresult cuCtxCreate_v2(void **, unsigned, int);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);

static double now_ns(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec * 1e9 + ts.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }

#define REPS 15
static double median(double *v) { qsort(v, REPS, sizeof *v, cmp); return v[REPS / 2]; }

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 200000;
    int dev; void *ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuCtxCreate_v2(&ctx, 0, dev)) { printf("FAIL init\n"); return 1; }
    double t[REPS];
    if (argc > 2 && !strcmp(argv[2], "host-backed")) {
        /* Opt-in oversubscription with the device share already full: every cuMemAlloc is
         * served from host memory (map, pin, device pointer; unpin, unmap at the free). */
        CUdeviceptr filler;
        if (cuMemAlloc_v2(&filler, 1 << 20)) { printf("FAIL filler\n"); return 1; }
        for (int r = 0; r < REPS; r++) {
            double t0 = now_ns();
            for (int i = 0; i < iters / 100; i++) { CUdeviceptr p; if (cuMemAlloc_v2(&p, 4096)) { printf("FAIL host-backed\n"); return 1; } cuMemFree_v2(p); }
            t[r] = (now_ns() - t0) / (iters / 100);
        }
        printf("cuMemAlloc+cuMemFree past the device share %.2f\n", median(t));
        return 0;
    }
    for (int r = 0; r < REPS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < iters; i++) cuLaunchKernel((void *)1, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);
        t[r] = (now_ns() - t0) / iters;
    }
    printf("cuLaunchKernel %.2f\n", median(t));
    for (int r = 0; r < REPS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < iters / 10; i++) { CUdeviceptr p; cuMemAlloc_v2(&p, 4096); cuMemFree_v2(p); }
        t[r] = (now_ns() - t0) / (iters / 10);
    }
    printf("cuMemAlloc+cuMemFree %.2f\n", median(t));
    for (int r = 0; r < REPS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < iters / 10; i++) { size_t f, tot; cuMemGetInfo_v2(&f, &tot); }
        t[r] = (now_ns() - t0) / (iters / 10);
    }
    printf("cuMemGetInfo %.2f\n", median(t));
    /* What nvidia-smi reads each refresh: the process list (two-call protocol, one call with
     * room) and the utilization. */
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    int (*init)(void) = nvml ? dlsym(nvml, "nvmlInit_v2") : 0;
    int (*handle)(unsigned, void **) = nvml ? dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2") : 0;
    int (*procs)(void *, unsigned *, void *) = nvml ? dlsym(nvml, "nvmlDeviceGetComputeRunningProcesses_v3") : 0;
    int (*util)(void *, unsigned *) = nvml ? dlsym(nvml, "nvmlDeviceGetUtilizationRates") : 0;
    void *h = 0;
    if (!init || !handle || !procs || !util || init() || handle(0, &h)) { printf("FAIL nvml\n"); return 1; }
    for (int r = 0; r < REPS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < iters / 100; i++) { unsigned n = 16; unsigned char buf[16 * 24]; procs(h, &n, buf); }
        t[r] = (now_ns() - t0) / (iters / 100);
    }
    printf("nvmlDeviceGetComputeRunningProcesses_v3 %.2f\n", median(t));
    for (int r = 0; r < REPS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < iters / 100; i++) { unsigned u[2]; util(h, u); }
        t[r] = (now_ns() - t0) / (iters / 100);
    }
    printf("nvmlDeviceGetUtilizationRates %.2f\n", median(t));
    return 0;
}
