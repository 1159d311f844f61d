#!/usr/bin/env bash
# Issues 9 and 10's acceptance figures on a GPU host, ours and mlx-lm's side by side. A device loan: call 1 stashes
# the site's part a (../shared/gpu/README.md), then this script on the warm host, one part a call (each under the
# device tool's 600 s):
#   PART=1  llama single stream 512 / 8K / 32K: ops.bench_kv (best of 3) and mlx-lm's model with its KVCache
#           in generate_step's pipelined loop (anchor_mlxlm_decode.py, two passes a context).
#   PART=2  qwen3 single stream against mlx-lm's generate_step (anchor_mlxlm_qwen3.py); llama batched decode at
#           1 / 8 / 32 / 64 streams against BatchGenerator (ops.bench_batching).
#   PART=3  issue 9's single-stream table (5 schemes, engines interleaved, two decode windows a turn, the first
#           untimed, 256 steps) for llama at 32K and 8K, then qwen3 at both (~300 s on an H100 host).
# Every step has a timeout and $OUT/all.tgz is rewritten after each, so a cut run still reports.
# The anchors are not in this repository (../shared/gpu): copy them into .gpu/b/ before PART 1 or 2.
#
#   call 2:  source .gpu/b/unpack.sh && PART=3 bash ops/gpu/acceptance_run.sh
#   later:   export PYTHONPATH=/tmp/gpu-site:$PWD && PART=1 bash ops/gpu/acceptance_run.sh
set -u
case "${PART:-1}" in 1 | 2 | 3) PART=${PART:-1} ;; *) echo "PART must be 1, 2 or 3" >&2; exit 2 ;; esac
OUT=$(realpath -m "${OUT:-/tmp/acceptance-out}")  # before the cd: a relative OUT is the caller's
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r; mkdir -p "$R"
T0=$SECONDS
pack() { tar czf "$OUT/all.tgz.tmp" -C "$OUT" r 2>/dev/null && mv "$OUT/all.tgz.tmp" "$OUT/all.tgz"; }
step() {  # step NAME SECONDS COMMAND...: run with a timeout (then KILL 10 s on), log its exit status, pack
  local name=$1 limit=$2 rc; shift 2
  timeout -k 10 "$limit" "$@" > "$R/$name.txt" 2>&1
  rc=$?
  echo "[$((SECONDS - T0))s] $name rc=$rc" | tee -a "$R/log.txt"; pack
}
timeout 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader > "$R/gpu_$PART.txt" 2>&1
SCHEMES=raw,affine8,affine4,aura8v4,aura4v4
if [ "$PART" = 1 ]; then
  step ours_llama 140 python3 -m ops.bench_kv --random-model llama-1b --contexts 512,8192,32768 --schemes raw \
    --steps 128 --repeats 3 --out "$R/ours_llama"
  mkdir -p "$R/mlxlm_llama"
  step mlxlm_llama 110 env OUT="$R/mlxlm_llama" python3 .gpu/b/anchor_mlxlm_decode.py 512,8192,32768,512,8192,32768
elif [ "$PART" = 3 ]; then  # an H100 host took 91 / 102 / 105 s (2026-12-07); the limits leave room for slower ones
  for table in llama-1b:32768:170 llama-1b:8192:150 qwen3-1.7b:32768,8192:220; do
    IFS=: read -r model contexts limit <<< "$table"
    step "table_${model}_${contexts/,/_}" "$limit" python3 -m ops.bench_kv --random-model "$model" --contexts "$contexts" \
      --schemes $SCHEMES --steps 256 --repeats 1 --interleave --turn-windows 2 --out "$R/table_${model}_${contexts/,/_}"
  done
else
  step ours_qwen3 150 python3 -m ops.bench_kv --random-model qwen3-1.7b --contexts 512,8192,32768 --schemes raw \
    --steps 128 --repeats 3 --out "$R/ours_qwen3"
  mkdir -p "$R/mlxlm_qwen3"
  step mlxlm_qwen3 150 env OUT="$R/mlxlm_qwen3" python3 .gpu/b/anchor_mlxlm_qwen3.py
  step batching_llama 200 python3 -m ops.bench_batching --random-model llama-1b --batch-sizes 1,8,32,64 --repeats 2 \
    --out "$R/batching_llama.json"
fi
echo "[$((SECONDS - T0))s] done" | tee -a "$R/log.txt"; pack
