/* One driver call in a loop, for `valgrind --tool=callgrind --toggle-collect=loop_<call>`:
 * instructions are counted only inside the loop function (and what it calls), so the total
 * divided by the iterations is the instructions per call, with or without libvgpu.so
 * preloaded (the caller decides). Usage: callgrind_bench launch|alloc_free|meminfo N */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned);
CUresult cuDeviceGet(int *, int);
CUresult cuCtxCreate_v2(void **, unsigned, int);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);

__attribute__((noinline)) void loop_launch(int n) {
    for (int i = 0; i < n; i++) cuLaunchKernel((void *)1, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);
}

__attribute__((noinline)) void loop_alloc_free(int n) {
    for (int i = 0; i < n; i++) { CUdeviceptr p; cuMemAlloc_v2(&p, 4096); cuMemFree_v2(p); }
}

__attribute__((noinline)) void loop_meminfo(int n) {
    for (int i = 0; i < n; i++) { size_t f, t; cuMemGetInfo_v2(&f, &t); }
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s launch|alloc_free|meminfo N\n", argv[0]); return 2; }
    int n = atoi(argv[2]);
    int dev; void *ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuCtxCreate_v2(&ctx, 0, dev)) { printf("FAIL init\n"); return 1; }
    /* Warm, outside the measured functions: the first calls resolve symbols and create the
     * shim's state. */
    for (int i = 0; i < 10; i++) {
        CUdeviceptr p; size_t f, t;
        cuLaunchKernel((void *)1, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);
        cuMemAlloc_v2(&p, 4096); cuMemFree_v2(p);
        cuMemGetInfo_v2(&f, &t);
    }
    if (!strcmp(argv[1], "launch")) loop_launch(n);
    else if (!strcmp(argv[1], "alloc_free")) loop_alloc_free(n);
    else if (!strcmp(argv[1], "meminfo")) loop_meminfo(n);
    else return 2;
    return 0;
}
