#!/usr/bin/env bash
# A lent GPU's session (15 minutes of device time, machine start included, 10 per command), as one
# prepared command run on the device tool (`run`, carry .whl; ../shared/GPU.md):
#
#   bash benchmarks/gpu_session.sh       # <= 8 min with its installs (GC_LIMIT=450 s for the steps):
#       the CUDA tests of the modules whose kernels changed since the last GPU run (b4c94e2: attention,
#       graphs, quantized GEMVs, the step's copies, warm-up), batch-1 decode in bf16 / int8 / fp8,
#       Offline bf16 and fp8 + fp8 KV (512 samples, 256 at once), a decode step of 256 x 4 beams
#       profiled (profile_steps.py); the 6B model is made beside the tests
#   bash benchmarks/gpu_session.sh 2     # a second lease: batch-32 decode, the GEMV plans at 1, 2, 4
#                                        # and 16 rows (gemv_sweep.py), Server with fp8
#   bash benchmarks/gpu_session.sh 3     # a third: SingleStream, `gptj submission --device cuda`
#                                        # (datacenter, open, short runs) checked by MLCommons' checker, carried
#                                        # as .mlperf-inference (a copy of ../shared/mlperf-inference, ignored),
#                                        # quant-report and accuracy
#
# Its Python packages: what the GPU machine lacks comes as wheels in .whl (../shared/GPU.md); without
# them it stops at once, saying which are missing, instead of failing steps one by one.
# Each part runs benchmarks/gpu_check.py's steps or gptj's commands (their logs in $GC_OUT, kept on
# the machine so the 6B model is made once), keeps each invocation's results.json, and packs the logs
# into $OUT/gpu-check-PART.tgz (the device tool returns at most 8 files). GC_LIMIT bounds a part's
# steps (seconds) so the packing still happens; GC_ARGS adds flags to every gpu_check invocation (a
# CPU rehearsal: GC_ARGS="--smoke --samples 8" GC_DEVICE=cpu GC_DTYPE=float32 GC_QUANT=int8 OUT=/tmp/o bash
# benchmarks/gpu_session.sh; part 3's also GC_SUB_QPS=5, after part 1's rehearsal made the tiny model;
# 2026-12-06 on a 2-core CPU: 4 min, the tests step 265 passed in 113 s).
set -u
part=${1:-1}
O=${GC_OUT:-/tmp/gpu-check}
LIMIT=${GC_LIMIT:-450}
mkdir -p "$O" "${OUT:?OUT: the folder whose files come back}"
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
missing=$(python3 - <<'PY'
import importlib.util
need = ["torch", "triton", "tokenizers", "safetensors", "mlperf_loadgen", "nltk", "rouge_score", "fastapi",
        "uvicorn", "pytest", "xdist", "absl"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "gpu_session.sh: this machine lacks $missing; bring them as wheels in .whl (../shared/GPU.md)" >&2
  exit 3
fi
export PYTEST_ADDOPTS="--timeout 150"   # one hung test must not take the part (pytest-timeout is there)
python3 -c "import pytest_timeout" 2>/dev/null || unset PYTEST_ADDOPTS
end=$(( $(date +%s) + LIMIT ))

gc() {  # gpu_check with these steps; stops at the part's limit; keeps its results.json
  local tag=$1; shift
  local left=$(( end - $(date +%s) ))
  if [ "$left" -le 10 ]; then echo "# $tag: skipped, the part's time is spent"; return; fi
  timeout "$left" python3 benchmarks/gpu_check.py --out "$O" "$@" ${GC_ARGS:-}
  [ -f "$O/results.json" ] && mv "$O/results.json" "$O/results-$tag.json"
}

case $part in
  1)
    (nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)") \
      > "$O/machine.txt" 2>&1
    gc model --steps model > "$O/model-part.txt" 2>&1 &   # CPU-bound (~1 min): beside the tests
    # the modules whose kernels or step code changed since b4c94e2, the last GPU run
    gc tests --steps tests --step-timeout 200 --test-workers 12 --test-files \
      tests/test_attention_backends.py,tests/test_graphs.py,tests/test_quant_cuda.py,tests/test_step_syncs.py,tests/test_warm_compiles.py
    wait
    gc b1 --steps bandwidth,latency-b1,latency-b1-MODE --quant-modes "${GC_QUANT:-int8,fp8}" --step-timeout 120
    # at gptj mlperf's default batch for CUDA (256 samples at once): two waves of samples
    gc offline --steps offline,offline-q --long-step-timeout 200 --samples 512
    # one decode step at that batch, host phases and the device's kernels by kind (bf16; fp8 + fp8 KV)
    for q in "" "--quantize fp8 --kv-dtype fp8"; do
      left=$(( end - $(date +%s) )); [ "$left" -le 20 ] && break
      tag=profile${q:+-fp8}
      timeout $(( left < 120 ? left : 120 )) python3 benchmarks/profile_steps.py --model "$O/model" --samples 256 \
        --device "${GC_DEVICE:-cuda}" --dtype "${GC_DTYPE:-bfloat16}" --out "$O/$tag" $q ${GC_ARGS:+--smoke --samples 2} \
        > "$O/$tag.txt" 2>&1; tail -14 "$O/$tag.txt"
    done
    ;;
  2)
    gc b32 --steps latency-b32 --step-timeout 120
    left=$(( end - $(date +%s) ))   # the GEMVs' launch plans (~2-3 min; results kept shape by shape): TILES
    timeout $(( left < 200 ? left : 200 )) python3 benchmarks/gemv_sweep.py --out "$O/gemv.json" --kinds int8,fp8 \
      --rows 1,2,4,16 ${GC_ARGS:+--smoke} > "$O/gemv.txt" 2>&1; tail -12 "$O/gemv.txt"
    gc server --steps bandwidth,server-q --server-seconds 30 --samples 128 --long-step-timeout 100
    ;;
  3)  # SingleStream, and a datacenter submission (Offline + Server) read by MLCommons' checker: short runs
      # (480 queries: about the fewest with which LoadGen's early stopping can judge a Server run)
    S="--model $O/model --device ${GC_DEVICE:-cuda} --dtype ${GC_DTYPE:-bfloat16} --quiet --min-duration-ms 1000"
    left() { echo $(( end - $(date +%s) )); }
    timeout "$(left)" python3 -m gptj.cli mlperf $S --scenario SingleStream --mode performance \
      --min-query-count 64 --target-latency-ms 2000 --log-dir "$O/singlestream" > "$O/singlestream.log" 2>&1
    tail -3 "$O/singlestream.log"
    mkdir -p "$O/sub-runs"  # what no program knows about the machine, as a submitter fills it in
    # the H200's name does not say its memory kind (an H100 SXM's does: the probe reads it there)
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" in
      *H200*) memory='"accelerator_memory_configuration": "HBM3e", ' ;; *) memory='' ;; esac
    echo '{"status": "available", "cooling": "air", "host_memory_configuration": "as lent",' "$memory" \
      '"host_storage_type": "SSD", "host_networking": "none", "host_network_card_count": "0"}' \
      > "$O/sub-runs/system_desc.json"
    checker=(); [ -d .mlperf-inference ] && checker=(--mlperf-inference .mlperf-inference)
    timeout "$(left)" python3 -m gptj.cli submission $S --out "$O/sub" --runs-dir "$O/sub-runs" --force \
      --submitter gptj --system-name gpu1 --division open --category datacenter --round v5.0 \
      --min-query-count 480 --target-qps "${GC_SUB_QPS:-8}" --max-new-tokens 32 "${checker[@]}" > "$O/submission.log" 2>&1
    echo "submission: exit $?"; tail -8 "$O/submission.log"
    # measured twice alike (2026-11-27, -28): again where the quantizers' numerics changed
    gc quant --steps quant-report --long-step-timeout 100
    gc accuracy --steps accuracy --quant-modes fp8 --long-step-timeout 100
    # SingleStream's step (1 sample x 4 beams): is its update (3.2 ms of 8.7 on 2026-11-28) the host's
    # own time or waiting on the device? Host phases without the profiler, then the kernels: if time is left
    if [ "$(left)" -gt 60 ]; then
      for k in --no-kernels ""; do
        timeout $(( $(left) - 5 )) python3 benchmarks/profile_steps.py --model "$O/model" --samples 1 --steps 20 \
          --device "${GC_DEVICE:-cuda}" --dtype "${GC_DTYPE:-bfloat16}" --out "$O/profile-1$k" $k \
          ${GC_ARGS:+--smoke --samples 1} > "$O/profile-1$k.txt" 2>&1; tail -8 "$O/profile-1$k.txt"
      done
    fi
    ;;
  *) echo "gpu_session.sh: part 1, 2 or 3" >&2; exit 2 ;;
esac
tar czf "$OUT/gpu-check-$part.tgz" --exclude=./model --exclude='*.safetensors' --exclude=mlperf_log_trace.json -C "$O" .
ls -la "$OUT"
