#!/usr/bin/env bash
# The shipped drafts keep greedy output the target's own: serve the default model plain, then
# with each shipped draft (EAGLE3, EAGLE, MTP), in float32 on this machine's device, ask each
# server for the same MT-bench first turns at temperature 0 over the OpenAI chat API, and
# compare the texts; /server_info's acceptance is printed with them.
#   bash tools/shipped_drafts_parity.sh [NUM_QUESTIONS (3)] [MAX_TOKENS (64)] [PORT (30111)]
# QUESTIONS: MT-bench's question.jsonl (default: where bench_speculative.py looks for it).
set -uo pipefail
cd "$(dirname "$0")/.."
num=${1:-3}; max_tokens=${2:-64}; port=${3:-30111}
questions=${QUESTIONS:-../shared/data/mt_bench_questions.jsonl}
out=$(mktemp -d)
for mode in plain EAGLE3 EAGLE MTP; do
  args=()
  [[ $mode != plain ]] && args=(--speculative-algorithm $mode)
  python3 launch.py --port $port --dtype float32 "${args[@]}" > "$out/server_$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
  python3 - "$port" "$mode" "$num" "$max_tokens" "$out" "$questions" <<'PY' || { kill -TERM $pid; exit 1; }
import json, sys, urllib.request
port, mode, out, path = sys.argv[1], sys.argv[2], sys.argv[5], sys.argv[6]
num, max_tokens = int(sys.argv[3]), int(sys.argv[4])
with open(path) as f:
    questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
texts = []
for q in questions[:: max(1, len(questions) // num)][:num]:  # spread over the categories
    body = {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(f"http://localhost:{port}/v1/chat/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    texts.append(json.load(urllib.request.urlopen(req, timeout=900))["choices"][0]["message"]["content"])
info = json.load(urllib.request.urlopen(f"http://localhost:{port}/server_info"))
json.dump({"texts": texts, "accept": info.get("avg_accept_length")}, open(f"{out}/{mode}.json", "w"))
PY
  kill -TERM $pid; wait $pid
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
plain = json.load(open(f"{out}/plain.json"))["texts"]
ok = True
for mode in ("EAGLE3", "EAGLE", "MTP"):
    run = json.load(open(f"{out}/{mode}.json"))
    same = [a == b for a, b in zip(plain, run["texts"], strict=True)]
    ok &= all(same)
    print(f"{mode}: identical to plain {sum(same)}/{len(same)}, accept length {run['accept']:.3f}")
sys.exit(0 if ok else 1)
PY
