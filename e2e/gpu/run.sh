#!/usr/bin/env bash
# Real-GPU check of libvgpu.so (Tessera's HAMi-core replacement). Needs one NVIDIA GPU, its
# driver, python3 with PyTorch, and either cargo (to build the shim) or VGPU_SHIM=<path to a
# built libvgpu.so>. nvcc is optional (used for the launch-overhead loop). Takes about 3-4 min.
#
#   e2e/gpu/run.sh                 # builds with cargo --release
#   VGPU_SHIM=/path/libvgpu.so e2e/gpu/run.sh
#
# Proves: (1) allocation past CUDA_DEVICE_MEMORY_LIMIT fails with OOM; (2) torch.cuda.mem_get_info
# and nvidia-smi show the limit; (3) two processes share one limit; (4) CUDA_DEVICE_SM_LIMIT=30
# brings a busy kernel loop near 30 %; (4b) under the default policy, the switch the device
# plugin's feedback writes for a lone container lifts that limit; (5) launch overhead of a
# small-kernel loop vs no shim; (6) module memory (a PTX module with a 1.5 GiB global) and memory
# a pool keeps after a free (PyTorch's cudaMallocAsync backend) count against the limit; (7) MIG,
# read only (the GPU's MIG mode is never changed): reports the mode NVML gives, and where MIG is
# enabled, that the device plugin's discovery (--print-register, --mig-strategy single) lists
# exactly the MIG instances nvidia-smi -L lists; (8) what the node's memory check sees: NVML's
# per-process memory of a shim process (the driver's own reservation) and of a dlmopen bypass;
# (9) opt-in oversubscription: past the device share, cuMemAlloc is served from host memory, the
# card holds only the share, the booking is enforced, and what host-backed memory costs; (10)
# serving patterns under one limit: vLLM-style memory profiling, CUDA graph replay, CUDA IPC
# between two processes (counted once), managed memory, expandable segments (cuMemCreate/Map);
# (11) NVML inside a container does not list another tenant's process; (6b) cuCtxSetLimit's
# memory (stack, heap) counts against the limit.
# TESSERA_DEVICE_PLUGIN=<path> skips its build.
# Exit status: number of failed checks.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT
FAILS=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }

if [ -z "${VGPU_SHIM:-}" ]; then
  cargo build --release -p libvgpu-shim >&2 || { echo "cargo build failed"; exit 100; }
  VGPU_SHIM=$(ls -t "${CARGO_TARGET_DIR:-$ROOT/target}"/release/libvgpu.so | head -1)
fi
[ -f "$VGPU_SHIM" ] || { echo "no libvgpu.so at $VGPU_SHIM"; exit 100; }
echo "shim: $VGPU_SHIM"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PY=${PYTHON:-python3}
$PY -c 'import torch; assert torch.cuda.is_available(); print("torch", torch.__version__, torch.cuda.get_device_name(0))' || exit 100

shim() { # shim <cache> <limit> cmd... : run with the shim preloaded
  local cache=$1 limit=$2; shift 2
  env LD_PRELOAD="$VGPU_SHIM" CUDA_DEVICE_MEMORY_SHARED_CACHE="$cache" CUDA_DEVICE_MEMORY_LIMIT="$limit" "$@"
}

echo "== 1. OOM past the limit, 2. mem_get_info shows it"
cat >"$WORK/oom.py" <<'EOF'
import torch, sys
G = 1 << 30
free, total = torch.cuda.mem_get_info()
print(f"mem_get_info: free={free/G:.3f} GiB total={total/G:.3f} GiB")
print(f"totalGlobalMem={torch.cuda.get_device_properties(0).total_memory/G:.3f} GiB")
ok = abs(total - 2 * G) < 1 << 20
a = torch.empty(int(1.5 * G), dtype=torch.uint8, device="cuda")
try:
    b = torch.empty(1 * G, dtype=torch.uint8, device="cuda")
    print("second allocation succeeded: NOT limited"); ok = False
except torch.cuda.OutOfMemoryError as e:
    print("second allocation: OutOfMemoryError as expected")
sys.exit(0 if ok else 1)
EOF
if shim "$WORK/oom.cache" 2g $PY "$WORK/oom.py"; then pass "OOM past 2 GiB and mem_get_info total = 2 GiB"; else fail "OOM / mem_get_info"; fi

echo "== 2b. nvidia-smi under the shim shows the limit"
SMI=$(shim "$WORK/oom.cache" 2g nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader,nounits | head -1)
echo "nvidia-smi (shim): $SMI MiB"
case "$SMI" in 2048,*) pass "nvidia-smi total = 2048 MiB";; *) fail "nvidia-smi total: $SMI";; esac

echo "== 3. two processes share one limit"
cat >"$WORK/hold.py" <<'EOF'
import torch, time, sys
G = 1 << 30
x = torch.empty(int(1.5 * G), dtype=torch.uint8, device="cuda")
open(sys.argv[1], "w").write("ready")
time.sleep(60)
EOF
cat >"$WORK/second.py" <<'EOF'
import torch, sys
G = 1 << 30
free, total = torch.cuda.mem_get_info()
print(f"second process sees free={free/G:.3f} GiB of {total/G:.3f}")
try:
    torch.empty(1 * G, dtype=torch.uint8, device="cuda"); print("1 GiB fit: NOT shared"); sys.exit(1)
except torch.cuda.OutOfMemoryError:
    print("1 GiB: OutOfMemoryError (the first process holds 1.5 GiB)")
torch.empty(int(0.25 * G), dtype=torch.uint8, device="cuda")
print("0.25 GiB: ok")
EOF
shim "$WORK/shared.cache" 2g $PY "$WORK/hold.py" "$WORK/ready" &
HOLD=$!
for _ in $(seq 100); do [ -f "$WORK/ready" ] && break; sleep 0.2; done
if shim "$WORK/shared.cache" 2g $PY "$WORK/second.py"; then pass "two processes share one 2 GiB limit"; else fail "shared limit"; fi
kill $HOLD 2>/dev/null; wait $HOLD 2>/dev/null

echo "== 4. CUDA_DEVICE_SM_LIMIT=30"
cat >"$WORK/busy.py" <<'EOF'
import torch, time, sys
secs = float(sys.argv[1])
a = torch.randn(4096, 4096, device="cuda"); b = torch.randn(4096, 4096, device="cuda")
end = time.time() + secs
n = 0
while time.time() < end:
    for _ in range(8):
        c = a @ b
    torch.cuda.synchronize(); n += 8
print(f"matmuls: {n} ({n/secs:.0f}/s)")
EOF
sample_util() { # average utilization.gpu over seconds 4..14 of a 15 s run
  local out=$1; : >"$out"
  for _ in $(seq 30); do nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits >>"$out"; sleep 0.5; done
}
$PY "$WORK/busy.py" 15 & B=$!; sample_util "$WORK/u100"; wait $B
env LD_PRELOAD="$VGPU_SHIM" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/sm.cache" CUDA_DEVICE_SM_LIMIT=30 \
  GPU_CORE_UTILIZATION_POLICY=force $PY "$WORK/busy.py" 15 & B=$!; sample_util "$WORK/u30"; wait $B
avg() { tail -n +9 "$1" | awk '{s+=$1; n++} END {printf "%.1f", s/n}'; }
U100=$(avg "$WORK/u100"); U30=$(avg "$WORK/u30")
echo "utilization: unlimited $U100 %, CUDA_DEVICE_SM_LIMIT=30: $U30 % (samples: $(tr '\n' ' ' <"$WORK/u30"))"
if awk -v u="$U30" 'BEGIN {exit !(u >= 20 && u <= 40)}'; then pass "SM limit 30 -> $U30 %"; else fail "SM limit 30 -> $U30 %"; fi

echo "== 4b. gpuCorePolicy default, alone: the monitor's feedback lifts the limit (utilization_switch = 0)"
# Writes the switch as the device plugin's feedback does for a lone container (offset 2008900).
$PY - "$WORK/lift.cache" <<'EOF' &
import os, struct, sys, time
for _ in range(80):
    if os.path.exists(sys.argv[1]) and os.path.getsize(sys.argv[1]) > 2008904:
        with open(sys.argv[1], "r+b") as f: f.seek(2008900); f.write(struct.pack("<i", 0))
    time.sleep(0.25)
EOF
env LD_PRELOAD="$VGPU_SHIM" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/lift.cache" CUDA_DEVICE_SM_LIMIT=30 \
  $PY "$WORK/busy.py" 15 & B=$!; sample_util "$WORK/ulift"; wait $B
ULIFT=$(avg "$WORK/ulift"); echo "utilization, limit lifted: $ULIFT %"
if awk -v u="$ULIFT" -v l="$U30" 'BEGIN {exit !(u >= l + 25)}'; then pass "lifted limit -> $ULIFT %"; else fail "lifted limit -> $ULIFT % (limited: $U30 %)"; fi

echo "== 5. launch overhead (small-kernel loop)"
if command -v nvcc >/dev/null; then
  cat >"$WORK/launch.cu" <<'EOF'
#include <cstdio>
#include <chrono>
#include <algorithm>
__global__ void k(int *p) { if (p) *p = 1; }
int main() {
  k<<<1, 32>>>(nullptr); cudaDeviceSynchronize();
  double best[9];
  for (int r = 0; r < 9; r++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 100000; i++) k<<<1, 32>>>(nullptr);
    cudaDeviceSynchronize();
    best[r] = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / 100000;
  }
  std::sort(best, best + 9);
  printf("%.1f\n", best[4]);
}
EOF
  nvcc -O2 -o "$WORK/launch" "$WORK/launch.cu" 2>&1 | grep -v warning
  L0=$("$WORK/launch"); L1=$(shim "$WORK/l.cache" 1g "$WORK/launch")
  L2=$(env LD_PRELOAD="$VGPU_SHIM" CUDA_DEVICE_MEMORY_SHARED_CACHE="$WORK/l2.cache" CUDA_DEVICE_SM_LIMIT=99 GPU_CORE_UTILIZATION_POLICY=force "$WORK/launch")
  echo "median ns per launch (100k empty kernels, median of 9): no shim $L0, shim $L1, shim + SM limit 99 % $L2"
else
  echo "nvcc not found: skipping the launch-overhead loop"
fi

echo "== 6. module and kept pool memory count (2 GiB limit)"
cat >"$WORK/modpool.py" <<'EOF'
import ctypes, sys, torch
G = 1 << 30
torch.empty(1, device="cuda")  # a current context on this thread
cu = ctypes.CDLL("libcuda.so.1")
def load(n):
    m = ctypes.c_void_p()
    ptx = f".version 7.0\n.target sm_70\n.address_size 64\n.visible .global .align 8 .b8 big[{n}];\n"
    return cu.cuModuleLoadData(ctypes.byref(m), ctypes.c_char_p(ptx.encode())), m
def alloc(n):
    p = ctypes.c_uint64()
    r = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    if r == 0: cu.cuMemFree_v2(p)
    return r
ok = True
r, m = load(int(1.5 * G)); print("load 1.5 GiB module:", r)
ok &= r == 0 and alloc(1 * G) == 2            # the module's 1.5 GiB leave < 1 GiB
r2, _ = load(1 * G); print("then a 1 GiB module:", r2); ok &= r2 == 2
ok &= cu.cuModuleUnload(m) == 0 and alloc(1 * G) == 0
x = torch.empty(int(1.5 * G), dtype=torch.uint8, device="cuda"); del x; torch.cuda.synchronize()
r = alloc(1 * G); print("1 GiB after 1.5 GiB freed into a keep-all pool:", r); ok &= r == 2
sys.exit(0 if ok else 1)
EOF
if shim "$WORK/modpool.cache" 2g env CUDA_MODULE_LOADING=EAGER PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync \
  $PY "$WORK/modpool.py"; then pass "module and pool memory counted"; else fail "module / pool memory"; fi

echo "== 6b. a context limit's memory counts (2 GiB limit): a 32 KiB stack is refused and set back"
cat >"$WORK/ctxlimit.py" <<'EOF'
import ctypes, sys, torch
torch.empty(1, device="cuda")
cu = ctypes.CDLL("libcuda.so.1"); v = ctypes.c_size_t()
cu.cuCtxGetLimit(ctypes.byref(v), 0); before = v.value
r = cu.cuCtxSetLimit(0, ctypes.c_size_t(32768))                # stack for every resident thread
cu.cuCtxGetLimit(ctypes.byref(v), 0)
print(f"stack 32 KiB: {r} (2 = out of memory); stack size now {v.value} (was {before})")
ok = r == 2 and v.value == before
f0 = torch.cuda.mem_get_info()[0]
r2 = cu.cuCtxSetLimit(2, ctypes.c_size_t(512 << 20))          # malloc heap
f1 = torch.cuda.mem_get_info()[0]
print(f"heap 512 MiB: {r2}; free {f0 >> 20} -> {f1 >> 20} MiB (a driver may reserve the heap only at the next launch: printed, not checked)")
ok &= r2 == 0
sys.exit(0 if ok else 1)
EOF
if shim "$WORK/ctx.cache" 2g $PY "$WORK/ctxlimit.py"; then pass "context limits counted"; else fail "context limits"; fi

echo "== 7. MIG, read only"
MIG_MODE=$(nvidia-smi -i 0 --query-gpu=mig.mode.current,mig.mode.pending --format=csv,noheader 2>/dev/null || echo "unknown")
echo "GPU 0 MIG mode (current, pending): $MIG_MODE"
if [ -z "${TESSERA_DEVICE_PLUGIN:-}" ]; then
  cargo build --release -p tessera-device-plugin >&2 || echo "device plugin build failed"
  TESSERA_DEVICE_PLUGIN=$(ls -t "${CARGO_TARGET_DIR:-$ROOT/target}"/release/tessera-device-plugin 2>/dev/null | head -1)
fi
if [ -x "${TESSERA_DEVICE_PLUGIN:-}" ]; then
  printf 'nvidia:\n  deviceSplitCount: 1\n' >"$WORK/dc.yaml"
  REG=$("$TESSERA_DEVICE_PLUGIN" --node-name gpu --config-file "$WORK/dc.yaml" --node-config "$WORK/none.json" \
    --mig-strategy single --print-register --sysfs-root /sys 2>"$WORK/reg.err")
  echo "register annotation: $REG"
  case "$MIG_MODE" in
    Enabled*)
      WANT=$(nvidia-smi -L | grep -o 'MIG-[0-9a-f-]*' | sort | tr '\n' ' ')
      GOT=$(echo "$REG" | grep -o 'MIG-[0-9a-f-]*' | sort -u | tr '\n' ' ')
      echo "nvidia-smi -L: $WANT"
      if [ "$WANT" = "$GOT" ]; then pass "discovery lists the MIG instances NVML reports"; else fail "MIG instances: nvidia-smi $WANT, discovery $GOT"; fi ;;
    *)
      if echo "$REG" | grep -q '"mode":"hami-core"'; then pass "MIG off: GPU 0 registered as shared"; else fail "MIG off, register: $REG $(cat "$WORK/reg.err")"; fi ;;
  esac
  AFTER=$(nvidia-smi -i 0 --query-gpu=mig.mode.current,mig.mode.pending --format=csv,noheader 2>/dev/null || echo "unknown")
  if [ "$AFTER" = "$MIG_MODE" ]; then pass "MIG mode unchanged ($AFTER)"; else fail "MIG mode changed: $MIG_MODE -> $AFTER"; fi
else
  echo "no device plugin binary: skipping the MIG discovery check"
fi

echo "== 8. what the node's memory check sees (NVML per process) against what the shim counts"
# (a) a process holding 1 GiB through the shim: NVML's per-process memory minus 1 GiB is what the
# driver reserves outside any allocation the shim sees (context, local memory): the chart's
# devicePlugin.unaccountedProcesses.memoryAllowanceMiB (1024 per process) must cover it.
# (b) cuda_probe bypass: a second copy of the driver (dlmopen) allocates 3000 MiB under a 1024 MiB
# limit; NVML must count it for the process, which is what GpuMemoryOverBooking reports.
# NVML is read outside the shim (as the node reads it): inside, the shim answers the process
# list with its own count (check 11), which would hide the driver's reservation.
cat >"$WORK/nvml_self.py" <<'EOF'
import os, sys, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
open(sys.argv[1], "w").write(str(os.getpid())); time.sleep(30)
EOF
cat >"$WORK/nvml_outside.py" <<'EOF'
import sys, pynvml
pid = int(open(sys.argv[1]).read())
pynvml.nvmlInit()
procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
mine = [p.usedGpuMemory for p in procs if p.pid == pid]
print(f"NVML (outside the shim) lists {len(procs)} process(es); the shim's process: {[m >> 20 for m in mine if m]} MiB")
print(f"OVERHEAD_MIB={(mine[0] >> 20) - 1024 if mine and mine[0] else -1}")
EOF
shim "$WORK/n8.cache" 2g $PY "$WORK/nvml_self.py" "$WORK/pid8" & HOLD8=$!
for _ in $(seq 150); do [ -s "$WORK/pid8" ] && break; sleep 0.2; done
OUT8=$($PY "$WORK/nvml_outside.py" "$WORK/pid8" 2>&1); echo "$OUT8"
kill $HOLD8 2>/dev/null; wait $HOLD8 2>/dev/null
OVER=$(echo "$OUT8" | sed -n 's/^OVERHEAD_MIB=//p')
if [ "${OVER:--1}" -lt 0 ]; then echo "NVML gives no per-process memory here: (a) not measured"
elif [ "$OVER" -le 1024 ]; then pass "per-process memory beyond the shim's count: $OVER MiB (allowance 1024)"
else fail "per-process memory beyond the shim's count, $OVER MiB, exceeds the 1024 MiB allowance"; fi
if cc -O1 -o "$WORK/cuda_probe" libvgpu-shim/tests/c/cuda_probe.c -ldl -lpthread -lcuda 2>"$WORK/cc.err"; then
  shim "$WORK/b8.cache" 1024m "$WORK/cuda_probe" bypass 3000 "$WORK/held" >"$WORK/bypass.out" 2>&1 &
  BP=$!
  for _ in $(seq 1 100); do [ -s "$WORK/held" ] && break; sleep 0.2; done
  SEEN=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -F', ' -v p="$BP" '$1==p {print $2}')
  echo "bypass held $(cat "$WORK/held" 2>/dev/null) MiB; nvidia-smi counts ${SEEN:-nothing} MiB for it; $(cat "$WORK/bypass.out")"
  kill "$BP" 2>/dev/null
  if grep -q 'init(0) returned' "$WORK/bypass.out"; then echo "the driver refuses a second copy of itself in one process: this route is closed here"
  elif [ -z "$SEEN" ]; then echo "nvidia-smi lists no process here: (b) not measured"
  elif [ "$SEEN" -ge 3000 ]; then pass "NVML counts the bypass's 3000 MiB past a 1024 MiB limit"
  else fail "NVML counts $SEEN MiB for the bypass"; fi
else
  echo "cuda_probe did not build: $(cat "$WORK/cc.err")"
fi

echo "== 9. opt-in oversubscription: 4 GiB booked, 1 GiB device share (TESSERA_DEVICE_MEMORY_SHARE_0)"
cat >"$WORK/oversub.py" <<'EOF'
import os, sys, time, subprocess, torch
G = 1 << 30
def smi_used():
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return {int(p): int(m) for p, m in (l.split(", ") for l in out.strip().splitlines() if ", " in l)}
free, total = torch.cuda.mem_get_info()
print(f"mem_get_info: total {total/G:.2f} GiB, free {free/G:.2f} GiB")
ok = abs(total - 4 * G) < (1 << 20)
dev = torch.ones(G // 4 // 4, device="cuda")                    # 0.25 GiB on the card
t0 = time.perf_counter(); host = torch.empty(3 * G // 4, dtype=torch.float32, device="cuda")  # 3 GiB: past the share
torch.cuda.synchronize(); t_host = time.perf_counter() - t0
host.fill_(2.0); s = host.sum().item()
print(f"3 GiB past the share: allocated in {t_host*1e3:.0f} ms, sum {s:.0f} (expected {2.0 * host.numel():.0f})")
ok &= s == 2.0 * host.numel()
mine = smi_used().get(os.getpid())
print(f"nvidia-smi: this process holds {mine} MiB on the card")
ok &= mine is not None and mine < 1024 + 600   # the share plus the driver's context, not 3.25 GiB
try:
    torch.empty(G, dtype=torch.uint8, device="cuda"); print("1 GiB more fit: NOT limited"); ok = False
except torch.cuda.OutOfMemoryError:
    print("1 GiB more: OutOfMemoryError (4 GiB booked)")
# Cost, same process: alloc+free of 512 MiB from the card (share has room) and from host
# memory (share full), and read+write bandwidth of a kernel on each.
del host; torch.cuda.empty_cache()
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
def alloc_free(n):
    p = ctypes.c_uint64(); t = time.perf_counter()
    r = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)); cu.cuMemFree_v2(p)
    return time.perf_counter() - t if r == 0 else float("nan")
med = lambda f, n=5: sorted(f() for _ in range(n))[n // 2]
a_dev = med(lambda: alloc_free(G // 2))
fill = torch.empty(G // 2 + G // 4, dtype=torch.uint8, device="cuda")  # the card's share is full
a_host = med(lambda: alloc_free(G // 2))
h = torch.empty(G // 4, dtype=torch.uint8, device="cuda")              # past the share: host-backed
del fill; torch.cuda.empty_cache()
d = torch.empty(G // 4, dtype=torch.uint8, device="cuda")              # on the card
def bw(x):
    def once():
        torch.cuda.synchronize(); t = time.perf_counter(); x.add_(1); torch.cuda.synchronize(); return time.perf_counter() - t
    return 2 * x.numel() / med(once) / 1e9
print(f"OVERSUB alloc+free 512 MiB, median of 5: device {a_dev*1e3:.2f} ms, host-backed {a_host*1e3:.2f} ms; "
      f"read+write bandwidth of a 256 MiB tensor: device {bw(d):.0f} GB/s, host-backed {bw(h):.1f} GB/s")
sys.exit(0 if ok else 1)
EOF
if shim "$WORK/over.cache" 4g env TESSERA_DEVICE_MEMORY_SHARE_0=1g $PY "$WORK/oversub.py"; then pass "oversubscription: past the share from host memory, booking enforced"; else fail "oversubscription"; fi

echo "== 10. serving patterns under a 2 GiB limit: graphs, memory profiling, expandable segments, IPC, managed"
cat >"$WORK/serving.py" <<'EOF'
import ctypes, sys, torch, torch.multiprocessing as mp
G = 1 << 30
def child(q, done):
    t = q.get()                                   # opened through CUDA IPC: counted by the exporter
    x = torch.empty(G // 2 + G // 4, dtype=torch.uint8, device="cuda")  # fits only if the import is not counted again
    done.put(float(t[0].item()))
def main():
    ok = True
    # vLLM-style profiling: free memory drops by exactly what a warm-up allocates.
    torch.cuda.init(); torch.empty(1, device="cuda")
    f0, tot = torch.cuda.mem_get_info()
    w = torch.empty(G // 2, dtype=torch.uint8, device="cuda")
    f1, _ = torch.cuda.mem_get_info()
    print(f"profiling: total {tot/G:.2f} GiB, free dropped {(f0-f1)/2**20:.0f} MiB for a 512 MiB warm-up")
    ok &= abs(tot - 2 * G) < (1 << 20) and f0 - f1 == G // 2
    del w; torch.cuda.empty_cache()
    # CUDA graph capture with allocations inside, replayed 200 times: usage does not grow.
    s = torch.cuda.Stream(); x = torch.ones(1 << 20, device="cuda")
    with torch.cuda.stream(s):
        for _ in range(3): y = x * 2
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = (x * 2).sum()
    before = torch.cuda.mem_get_info()[0]
    for _ in range(200): g.replay()
    torch.cuda.synchronize()
    after = torch.cuda.mem_get_info()[0]
    print(f"graph: replayed 200 times, free {before/2**20:.0f} -> {after/2**20:.0f} MiB, result {y.item():.0f}")
    ok &= after == before and y.item() == 2 * (1 << 20)
    del g, y, x; torch.cuda.empty_cache()
    # IPC: a tensor shared with a second process of the container is counted once.
    t = torch.full((G // 4,), 7.0, device="cuda")  # 1 GiB
    ctx = mp.get_context("spawn"); q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, done)); p.start(); q.put(t)
    try:
        seen = done.get(timeout=120); print(f"IPC: the second process read {seen:.0f} and allocated 0.75 GiB beside the shared 1 GiB")
        ok &= seen == 7.0
    except Exception as e:
        print(f"IPC: the second process failed: {e}"); ok = False
    p.join(60); ok &= p.exitcode == 0
    del t; torch.cuda.empty_cache()
    # Managed memory counts against the limit.
    cu = ctypes.CDLL("libcuda.so.1"); m = ctypes.c_uint64(); d = ctypes.c_uint64()
    r1 = cu.cuMemAllocManaged(ctypes.byref(m), ctypes.c_size_t(G), 1)
    r2 = cu.cuMemAlloc_v2(ctypes.byref(d), ctypes.c_size_t(G + G // 2))
    print(f"managed 1 GiB: {r1}; then cuMemAlloc 1.5 GiB: {r2} (2 = out of memory)")
    ok &= r1 == 0 and r2 == 2
    cu.cuMemFree_v2(m)
    sys.exit(0 if ok else 1)
if __name__ == "__main__":
    main()
EOF
if shim "$WORK/serve.cache" 2g $PY "$WORK/serving.py"; then pass "serving patterns held to one 2 GiB limit"; else fail "serving patterns"; fi
cat >"$WORK/expand.py" <<'EOF'
import sys, torch
G = 1 << 30
xs = []
try:
    for i in range(64): xs.append(torch.empty(G // 8, dtype=torch.uint8, device="cuda"))
    print("expandable segments: 8 GiB fit: NOT limited"); sys.exit(1)
except torch.cuda.OutOfMemoryError:
    print(f"expandable segments (cuMemCreate/cuMemMap): OutOfMemoryError after {len(xs)/8:.3f} GiB")
    sys.exit(0 if 1.5 <= len(xs) / 8 <= 2 else 1)
EOF
if shim "$WORK/exp.cache" 2g env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $PY "$WORK/expand.py"; then pass "expandable segments held to 2 GiB"; else fail "expandable segments"; fi

echo "== 10b. a CUDA graph captured with stream-ordered allocations (cudaMallocAsync backend) is counted"
cat >"$WORK/capture.py" <<'EOF'
import ctypes, sys, torch
M = 1 << 20
x = torch.ones(64 * M, device="cuda")                       # 256 MiB
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    for _ in range(3): y = ((x * 2) + 1).sum()
torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    t1 = x * 2; t2 = t1 + 1; y = t2.sum()                     # 512 MiB of intermediates inside the graph
del t1, t2
for _ in range(100): g.replay()
torch.cuda.synchronize()
cu = ctypes.CDLL("libcuda.so.1"); held = ctypes.c_uint64()
cu.cuDeviceGetGraphMemAttribute(0, 2, ctypes.byref(held))      # what the driver holds for graphs
free, total = torch.cuda.mem_get_info()
print(f"after 100 replays: result {y.item():.0f}, the driver holds {held.value // M} MiB for graphs, "
      f"the shim counts {(total - free) // M} MiB in use of {total // M}")
ok = abs(y.item() - 3 * 64 * M) < 1e4 and total - free >= held.value + 256 * M
try:
    torch.empty(free + 64 * M, dtype=torch.uint8, device="cuda"); print("past free: NOT limited"); ok = False
except torch.cuda.OutOfMemoryError:
    print("past free: OutOfMemoryError")
sys.exit(0 if ok else 1)
EOF
if shim "$WORK/cap.cache" 2g env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync $PY "$WORK/capture.py"; then pass "captured graph memory counted"; else fail "captured graph memory"; fi

echo "== 11. NVML inside a container lists none of another tenant's processes"
# The public NVML calls answer with the container's processes (pynvml, vLLM, nvitop). nvidia-smi
# reads its process table through NVML's private export table, which the shim cannot filter
# (refusing that table makes nvidia-smi exit 255): printed, not checked (docs/security.md).
$PY "$WORK/hold.py" "$WORK/ready11" & OTHER=$!
for _ in $(seq 100); do [ -f "$WORK/ready11" ] && break; sleep 0.2; done
INSIDE=$(shim "$WORK/n11.cache" 2g $PY -c 'import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
print(" ".join(str(p.pid) for f in (n.nvmlDeviceGetComputeRunningProcesses, n.nvmlDeviceGetGraphicsRunningProcesses) for p in f(h)))')
SMI=$(shim "$WORK/n11.cache" 2g nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr '\n' ' ')
echo "another tenant: $OTHER; inside a 2 GiB container: NVML lists [$INSIDE], nvidia-smi's own table [$SMI]"
kill $OTHER 2>/dev/null; wait $OTHER 2>/dev/null
case " $INSIDE " in *" $OTHER "*) fail "NVML lists another tenant's process inside";; *) pass "NVML does not list another tenant's process inside";; esac

echo "== done: $FAILS failure(s)"
exit $FAILS
