#!/usr/bin/env bash
# The CUDA path's checks and measurements (issue 44), in one run on a GPU machine with no network:
#   scripts/gpu-check.sh [PART...]     PART: env tests kernels latency eager quant kv moe throughput steps
#                                      doctor profile (default: all of these), sparse (asked for by name)
# TESTS: the test files of `tests` (default: both CUDA files), run by WORKERS pytest workers (default 8) for at most
# TEST_LIMIT seconds (default 420); PEERS=0 leaves HF transformers out of `latency` and `throughput`.
# TEST_FILTER: a pytest -k expression over them. The machine needs CUDA torch (Triton comes with it); what else
# ridge needs travels as wheels in .whl (scripts/gpu-wheels.sh makes them), installed here before anything runs;
# ridge runs from this checkout's src/.
# Models are random-weight (`--model random:llama-3-8b`, $MODEL to change it). Each measurement's JSON and log
# land in $OUT (default ./gpu-results); a summary line per measurement is printed.
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ridge-site \
    .whl/*.whl || exit 1
  PYTHONPATH=/tmp/ridge-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
MODEL=${MODEL:-random:llama-3-8b}
PARTS=${*:-env tests kernels latency eager quant kv moe throughput steps doctor profile}
TESTS=${TESTS:-tests/test_triton_kernels.py tests/test_cuda.py}
PEERS=${PEERS:-1}
WORKERS=${WORKERS:-8}
TEST_LIMIT=${TEST_LIMIT:-420}
TEST_FILTER=${TEST_FILTER:-}
NO_PEERS=$( [ "$PEERS" = 0 ] && echo --no-peers )

# run NAME LIMIT_S COMMAND...: stdout to NAME.json, stderr to NAME.log, a summary of the JSON printed
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T)): $*"
  timeout "$limit" "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
  echo "   exit $?"
  "$PY" - "$OUT/$name.json" "$OUT/$name.log" <<'PYEOF'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except Exception:
    print("   no JSON; log tail:", *open(sys.argv[2]).read().splitlines()[-8:], sep="\n   ")
    raise SystemExit
for r in report.get("results", []):
    f = r.get("figures", {})
    keep = {k: round(v, 3) if isinstance(v, float) else v for k, v in f.items()
            if k in ("prefill_tok_s", "decode_tok_s", "roofline_fraction", "weight_gb_s", "gpu_busy_fraction",
                     "output_tok_s", "total_tok_s", "gflop_s", "elapsed_s")}
    print(f"   {r['engine']:<8} {keep} {r.get('note', '')} {r.get('error') or ''}")
if "machine" in report:
    print("   machine:", report["machine"], report.get("device", ""))
PYEOF
}

for part in $PARTS; do
  case $part in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" ;;
    tests)
      echo "== tests ($(date +%T))"
      # workers share the GPU; Triton's compiles and the CPU engines the quantized checks compare with run beside
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=2 timeout "$TEST_LIMIT" "$PY" -m pytest -q -rf -p no:cacheprovider -n "$WORKERS" --timeout 200 \
        ${TEST_FILTER:+-k "$TEST_FILTER"} $TESTS 2>&1 | tee "$OUT/tests.log" | tail -n 40 ;;
    kernels)  # the quantized matmuls alone at one row: every tuning candidate, cuBLAS bf16 and tinygemm
      echo "== kernels ($(date +%T))"
      OUT="$OUT" timeout 240 "$PY" scripts/quant_kernels.py 2>"$OUT/kernels.log" | tee "$OUT/kernels.txt"
      echo "   exit $?"; tail -n 3 "$OUT/kernels.log" ;;
    latency)
      run latency-bf16 300 "$PY" -m ridge.cli bench latency --model "$MODEL" --device cuda --input-len 128 \
        --output-len 128 --repeats 3 $NO_PEERS --json ;;
    eager)
      run latency-bf16-eager 200 "$PY" -m ridge.cli bench latency --model "$MODEL" --device cuda --input-len 128 \
        --output-len 64 --repeats 2 --no-peers --enforce-eager --json ;;
    quant)
      for q in int8 fp8 int4; do
        extra=(); [ "$q" != int4 ] && extra=(--calibration-windows 0)  # no calibration text without a network
        run "latency-$q" 200 "$PY" -m ridge.cli bench latency --model "$MODEL" --device cuda --input-len 128 \
          --output-len 128 --repeats 3 --no-peers --quantization "$q" "${extra[@]}" --json
      done ;;
    kv)  # decode at long context over each KV format (issue 47): the Triton kernels reading codes, side by side
      echo "== kv ($(date +%T))"
      timeout 300 "$PY" -m ridge.cli bench kv --model "$MODEL" --device cuda --context 8000 --batch 16 --steps 8 \
        --kv-cache-memory 24GiB --kv-cache-dtypes auto,fp8,int8,int4 --max-num-batched-tokens 8192 \
        2>"$OUT/kv.log" | tee "$OUT/kv.txt"
      echo "   exit $?"; tail -n 3 "$OUT/kv.log" ;;
    moe)  # issue 46: batch-1 decode of a mixture (Qwen3-30B-A3B's layers, 24 of 48) and of latent attention
      # (DeepSeek-V2-Lite whole): the printed roofline fraction is of the active bytes a step reads
      run latency-moe 150 "$PY" -m ridge.cli bench latency --model "random:qwen3-30b-a3b,num_layers=24" \
        --device cuda --input-len 128 --output-len 64 --repeats 2 --no-peers --json
      run latency-mla 150 "$PY" -m ridge.cli bench latency --model "random:deepseek-v2-lite" --device cuda \
        --input-len 128 --output-len 64 --repeats 2 --no-peers --json ;;
    sparse)  # DeepSeek sparse attention by context (GLM-5's layers, 4 of 78): its indexer's top 2,048 against every
      # key (a top k past any context here), the same draw; decode ms per token at 4k-32k
      echo "== sparse ($(date +%T))"
      glm="random:glm-5,num_layers=4,num_experts=16,first_dense_layers=1,vocab_size=49152"
      timeout 480 "$PY" -m ridge.cli bench context --models "$glm,index_topk=2048;$glm,index_topk=65536" \
        --device cuda --contexts 4096,16384,32768 --output-len 64 --repeats 1 --no-peers --json \
        > "$OUT/sparse.json" 2> "$OUT/sparse.log"
      echo "   exit $?"; tail -n 3 "$OUT/sparse.log" ;;
    throughput)
      run throughput 480 "$PY" -m ridge.cli bench throughput --model "$MODEL" --device cuda --workload random \
        --num-prompts 256 --input-len 512 --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --kv-cache-memory 24GiB --hf-batch-size 64 --json $NO_PEERS ;;
    steps)  # the throughput workload step by step, twice (the first run compiles what the warm-up did not): time in
      # steps with prefill chunks and in pure decode steps; then the top GPU kernels of a profiled quarter of it
      echo "== steps ($(date +%T))"
      timeout 300 "$PY" - "$MODEL" > "$OUT/steps.txt" 2> "$OUT/steps.log" <<'PYEOF'
import sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from ridge import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda", progress=False, max_num_seqs=256, max_num_batched_tokens=8192,
          kv_cache_memory="24GiB")
engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
gen = torch.Generator().manual_seed(0)
def prompts(n):
    return [torch.randint(1000, 30000, (512,), generator=gen).tolist() for _ in range(n)]
def run(batch):
    for ids in batch:
        engine.add_request(ids, params)
    times = {"prefill": [], "decode": []}
    started = time.perf_counter()
    while engine.has_unfinished:
        t = time.perf_counter()
        engine.step()
        times["prefill" if engine.last_step.prefill_tokens else "decode"].append(time.perf_counter() - t)
    return time.perf_counter() - started, times
run(prompts(8))
for label in ("first", "second"):
    wall, times = run(prompts(256))
    print(f"{label} run, 256 x (512 + 128): {wall:.2f} s, {256 * 128 / wall:.0f} output tok/s")
    for kind, t in times.items():
        print(f"  steps with {kind}: {len(t)}, {sum(t):.2f} s, {1e3 * sum(t) / max(len(t), 1):.1f} ms each")
    print("  prefill steps, ms:", " ".join(f"{1e3 * x:.0f}" for x in times["prefill"]))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    wall, _ = run(prompts(64))
events = prof.key_averages()
print(f"profiled 64 requests: {wall:.2f} s wall")
print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70))
PYEOF
      echo "   exit $?"; cut -c1-170 "$OUT/steps.txt" | head -n 40; tail -n 3 "$OUT/steps.log" ;;
    doctor)
      echo "== doctor ($(date +%T))"
      timeout 200 "$PY" -m ridge.cli doctor --model "$MODEL" --device cuda --output-len 32 --batch 16 \
        2>"$OUT/doctor.log" | tee "$OUT/doctor.txt" ;;
    profile)  # where a batch-1 decode step's time goes: the top GPU kernels and the host's ops
      echo "== profile ($(date +%T))"
      timeout 200 "$PY" - "$MODEL" > "$OUT/profile.txt" 2> "$OUT/profile.log" <<'PYEOF'
import sys
from torch.profiler import ProfilerActivity, profile
from ridge import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda", progress=False, enable_prefix_caching=False)
params, ids = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), list(range(1000, 1128))
llm.generate(ids, params)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(ids, params)
events = prof.key_averages()
print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
PYEOF
      echo "   exit $?"; cut -c1-160 "$OUT/profile.txt" | head -n 60 ;;
    *) echo "unknown part: $part"; exit 2 ;;
  esac
done
