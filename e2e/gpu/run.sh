#!/usr/bin/env bash
# Real-GPU check of libvgpu.so (Tessera's HAMi-core replacement). Needs one NVIDIA GPU, its
# driver, python3 with PyTorch, and either cargo (to build the shim) or VGPU_SHIM=<path to a
# built libvgpu.so>. nvcc is optional (used for the launch-overhead loop). Takes about 2-3 min.
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
# per-process memory of a shim process (the driver's own reservation) and of a dlmopen bypass.
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
cat >"$WORK/nvml_self.py" <<'EOF'
import os, torch, pynvml
G = 1 << 30
x = torch.empty(1 * G, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid()]
print(f"NVML lists {len(procs)} process(es); this one: {[m >> 20 for m in mine if m]} MiB")
print(f"OVERHEAD_MIB={(mine[0] >> 20) - 1024 if mine and mine[0] else -1}")
EOF
OUT8=$(shim "$WORK/n8.cache" 2g $PY "$WORK/nvml_self.py" 2>&1); echo "$OUT8"
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

echo "== done: $FAILS failure(s)"
exit $FAILS
