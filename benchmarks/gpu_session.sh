#!/usr/bin/env bash
# The GPU checks and timings on a lent GPU, as one prepared script (the device tool runs it in the repository root):
#   bash benchmarks/gpu_session.sh [steps]      steps: a comma list of env,eager,numerics,mela,mela-graphs,
#                                               mela-compiled,mela-graphs-compiled,mela-calls,cpu-numerics,tests,
#                                               compile,kernels,float8,mela-fp32 (default:
#                                               env,eager,mela,mela-graphs,mela-calls,cpu-numerics,tests)
# The lent machine has torch, lightning and torchmetrics but not this package's other dependencies: where
# .whl/ holds their Python 3.12 wheels (benchmarks/gpu_wheels.sh downloads them), they are installed into
# /tmp/site first.
# Each step has its own time limit and log ($OUT/<step>.log, or ./gpu-logs/ without $OUT), so a step that fails
# or runs long leaves the others' figures.
set -u
STEPS=${1:-env,eager,mela,mela-graphs,mela-calls,cpu-numerics,tests}
LOGS=${OUT:-gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 LITDATA_DISABLE_VERSION_CHECK=1
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >"$LOGS/pip.log" 2>&1 || echo "pip install of .whl failed: see pip.log"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
step() {  # step NAME SECONDS CMD...: run CMD under a limit, its output to the terminal and NAME.log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOGS/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}
if has env; then
  step env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
    python3 -c "import torch, lightning, mlflow, litdata; print(\"torch\", torch.__version__, \"lightning\",
    lightning.__version__, \"mlflow\", mlflow.__version__, \"cuda\", torch.version.cuda,
    torch.cuda.get_device_name()); import recursive_lightning.training.run"'
fi
# timings first, on a quiet GPU: SpiralFormer-B / LoopedFormer and MeSH / base, eager and replayed as CUDA graphs,
# both sizes and lengths
has eager && step eager "${EAGER_LIMIT:-190}" python3 benchmarks/bench_gpu.py --goals --modes "${EAGER_MODES:-eager,graphs}" \
  --reps 6 --warmup 2
# Mela's float32 and bf16 logits against the CPU's float64, chunk by chunk (the bounded step, docs/models.md: Numerics)
# and the memory's GEMMs in float32, the GPU's own TF32 (what train uses under bf16-mixed) and emulated TF32 / bf16
has numerics && step numerics "${NUMERICS_LIMIT:-90}" python3 benchmarks/bench_mela_numerics.py --device cuda \
  --chunks 64 --batch 2 --carries cycles --updates newton_schulz,forgetting --memory-gemms float32,tf32-cuda,tf32,bf16
# with Mela's fused memory updates (train.memory_kernel: triton) as a fourth model taking turns with the three
has mela && step mela "${MELA_LIMIT:-150}" python3 benchmarks/bench_gpu_mela.py --part "${MELA_PART:-train}" --reps 6 \
  --memory-kernel
# each model's step replayed as one CUDA graph, the fused memory updates' kernels (compiled by the step above)
# captured in Mela's
has mela-graphs && step mela-graphs "${MELA_GRAPHS_LIMIT:-120}" python3 benchmarks/bench_gpu_mela.py --part train --graphs \
  --reps 6 --memory-kernel
# the memory's GEMMs in full FP32 (torch's "highest"), against the `mela` step's TF32: what TF32 saves a Mela step
has mela-fp32 && step mela-fp32 "${MELA_FP32_LIMIT:-120}" python3 benchmarks/bench_gpu_mela.py --part train \
  --matmul-precision highest --reps 6
# Mela and Transformer++ with train.compile: glue (the layers, and each neural memory's projections and chunk
# update), and Mela compiled so with its memory updates fused: the combination that launches fewest kernels on
# the CPU's count (docs/benchmarks.md: Mela)
has mela-compiled && TORCH_LOGS="${MELA_TORCH_LOGS:-recompiles}" step mela-compiled "${MELA_COMPILE_LIMIT:-240}" \
  python3 benchmarks/bench_gpu_mela.py \
  --part train --compile glue --reps 6 --memory-kernel
# both: the compiled regions' fused kernels captured and replayed as one CUDA graph per step (compiled in the
# capture's warm-up steps), the candidate for Mela's memory loop once neither the host nor unfused element-wise
# kernels bound it; train refuses train.compile with train.cuda_graphs until this measures a gain
has mela-graphs-compiled && TORCH_LOGS="${MELA_TORCH_LOGS:-recompiles}" step mela-graphs-compiled \
  "${MELA_GRAPHS_COMPILE_LIMIT:-240}" python3 benchmarks/bench_gpu_mela.py --part train --graphs --compile glue --reps 6
# the host-work proxy on this machine's CPU: leaf ATen calls of one fwd+bwd of mela-400m's structure at 4K against
# transformerpp-400m's (PASS/MISS: at most 2x); counts, not timings, so it runs beside nothing else on the GPU
has mela-calls && step mela-calls "${MELA_CALLS_LIMIT:-150}" env CUDA_VISIBLE_DEVICES= \
  python3 benchmarks/bench_host_overhead.py --mela --totals
# the Mela numerics tests on this machine's CPU (another vendor than the development machine's), 1 and 2 threads
has cpu-numerics && step cpu-numerics "${CPU_NUMERICS_LIMIT:-80}" bash -c 'lscpu | grep -m1 "Model name";
  for t in 1 2; do OMP_NUM_THREADS=$t CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider \
    tests/model/test_mela.py -k "float32_matches_float64 or bf16_autocast_error or amplifies" 2>&1 | tail -3; done;
  CUDA_VISIBLE_DEVICES= python3 benchmarks/bench_mela_numerics.py --carries cycles --threads 1,2'
has tests && step tests "${TESTS_LIMIT:-270}" python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 240 tests/test_cuda.py -rfEs \
  ${TESTS_K:+-k "$TESTS_K"}
# the model's loss, norm, MLP activation and rotary against liger-kernel's fused Triton kernels (its wheel in .whl),
# at both 400M models' sizes
has kernels && step kernels "${KERNELS_LIMIT:-120}" bash -c 'python3 benchmarks/bench_gpu_kernels.py;
  python3 benchmarks/bench_gpu_kernels.py --preset pythia-410m'
# torchao's float8 training (its wheel in .whl) against bf16, compiled layers, transformerpp-400m and 410M LoopedFormer
has float8 && step float8 "${FLOAT8_LIMIT:-240}" python3 benchmarks/bench_float8.py --reps 6
# compiled scopes and CUDA graphs beside eager, where the time is left
has compile && step compile "${COMPILE_LIMIT:-240}" python3 benchmarks/bench_gpu.py --goals \
  --presets "${COMPILE_PRESETS:-pythia-410m}" --seq-lens "${COMPILE_SEQ:-4096}" \
  --modes "${COMPILE_MODES:-eager,glue,model}" --reps 8 --warmup 2
echo "=== the goals"
grep -h -E "^ *(PASS|MISS)" "$LOGS"/*.log
exit 0
