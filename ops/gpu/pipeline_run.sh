#!/usr/bin/env bash
# The serving pipeline on the GPU host in one call (issue 10 item 3, issue 17):
#   1. a random-weight model folder under /tmp (ops.random_model, SHAPE, bf16 on a GPU);
#   2. `core`: the engine's EngineCore in process at each concurrency (the baseline);
#   3. `serve --engines 1`: the same load through the pipeline;
#   4. `serve --engines 2` (one per GPU; on one GPU both share it) and the kill-one-engine check.
# Every phase has a timeout; JSON is rewritten after every level, so a cut run still reports.
# Output: $OUT/<name>.json (pipeline_gpu_<shape>.json on 1 GPU, engines2_gpu_<shape>.json on 2+,
# pipeline_cpu_<shape>.json on the CPU), serve logs, phases.log; GPU JSON is copied to ops/results/.
#
#   GPU host:  source .gpu/b/unpack.sh; set +e; OUT=$OUT bash ops/gpu/pipeline_run.sh
#   CPU here:  DEVICE=cpu SHAPE=tiny PYTHON=.venv/bin/python OUT=/tmp/pipeline ops/gpu/pipeline_run.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -d /tmp/gpu-site/mlx ] && [[ ":${PYTHONPATH:-}:" != *":/tmp/gpu-site:"* ]]; then
  export PYTHONPATH=/tmp/gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
PY=${PYTHON:-python3}
SHAPE=${SHAPE:-llama-1b}
DEVICE=${DEVICE:-auto}
OUT=${OUT:-/tmp/pipeline-out}
mkdir -p "$OUT"
START=$SECONDS

if [ "$DEVICE" = cpu ]; then
  NGPU=0; DTYPE=${DTYPE:-float32}; TAG=cpu
  CONC=${CONC:-1,4}; PROMPT=${PROMPT:-64}; MAXTOK=${MAXTOK:-32}; KILL_STREAMS=${KILL_STREAMS:-8}; KILL_MAXTOK=${KILL_MAXTOK:-1024}
  T_BUILD=120; T_CORE=150; T_E1=150; T_E2=200
else
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); DTYPE=${DTYPE:-bfloat16}; TAG=gpu
  if [ "${NGPU:-0}" -eq 0 ]; then  # no nvidia-smi: ask MLX, and list the GPUs for serve's placement
    NGPU=$($PY -c 'import mlx.core as mx; print(mx.device_count(mx.gpu) if mx.is_available(mx.gpu) else 0)' 2>/dev/null || echo 0)
    [ "$NGPU" -gt 0 ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ] && export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NGPU - 1)))
  fi
  CONC=${CONC:-1,8,16,32,64}; PROMPT=${PROMPT:-512}; MAXTOK=${MAXTOK:-128}; KILL_STREAMS=${KILL_STREAMS:-32}; KILL_MAXTOK=${KILL_MAXTOK:-512}
  T_BUILD=${T_BUILD:-60}; T_CORE=${T_CORE:-110}; T_E1=${T_E1:-120}; T_E2=${T_E2:-190}
fi
if [ "${NGPU:-0}" -ge 2 ]; then NAME=engines2_${TAG}_${SHAPE}; LABEL=""; else NAME=pipeline_${TAG}_${SHAPE}; LABEL=_one_device; fi
JSON=$OUT/$NAME.json
MODEL=/tmp/random-$SHAPE-$DTYPE
rm -f "$JSON"
# serve's gateway imports its HTTP API and metrics: the GPU bundle needs these beside mlx and pyzmq.
MISSING=$($PY -c 'import importlib.util as u; print(" ".join(m for m in ("mlx", "mlx_lm", "zmq", "pydantic_settings", "structlog", "tokenizers", "transformers", "starlette", "uvicorn", "prometheus_client", "anyio", "h11", "click") if u.find_spec(m) is None))')
if [ -n "$MISSING" ]; then
  echo "{\"error\": \"python modules missing: $MISSING\"}" > "$JSON"
  echo "ABORT: python modules missing: $MISSING (pack them: ../shared/gpu/prepare.sh starlette uvicorn prometheus-client anyio h11 click idna)"
  exit 3
fi
echo "gpus=$NGPU shape=$SHAPE dtype=$DTYPE conc=$CONC -> $JSON" | tee "$OUT/phases.log"

# Stop a serve that outlived its driver (the driver was SIGKILLed by timeout -k).
reap() {
  for f in "$OUT"/*.pid; do
    [ -e "$f" ] || continue
    pid=$(cat "$f"); kill -TERM -- "-$pid" 2>/dev/null; sleep 3; kill -KILL -- "-$pid" 2>/dev/null; rm -f "$f"
  done
}
phase() {  # phase NAME TIMEOUT_S CMD...: run, log wall time and status
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  timeout -k 15 "$limit" "$@" > "$OUT/$name.out" 2>&1
  local rc=$?
  reap
  echo "$name rc=$rc wall_s=$((SECONDS - t0)) total_s=$((SECONDS - START))" | tee -a "$OUT/phases.log"
  tail -n 3 "$OUT/$name.out" | cut -c1-300
}
BENCH=($PY -m ops.serve_bench --model "$MODEL" --out "$JSON" --device "$DEVICE" --dtype "$DTYPE" --concurrency "$CONC"
       --prompt-tokens "$PROMPT" --max-tokens "$MAXTOK" --kill-streams "$KILL_STREAMS" --kill-max-tokens "$KILL_MAXTOK")

phase build "$T_BUILD" $PY -m ops.random_model --shape "$SHAPE" --out "$MODEL" --dtype "$DTYPE"
cp "$OUT/build.out" "$OUT/build.json" 2>/dev/null
phase core "$T_CORE" "${BENCH[@]}" --phases core --deadline-s $((T_CORE - 40))
phase serve_e1 "$T_E1" "${BENCH[@]}" --phases serve --engines 1 --deadline-s $((T_E1 - 40))
phase serve_e2 "$T_E2" "${BENCH[@]}" --phases serve,kill --engines 2 --label "$LABEL" --deadline-s $((T_E2 - 110))

$PY - "$JSON" "$OUT" "$NGPU" <<'EOF'
import json, shutil, subprocess, sys
from pathlib import Path
from ops.serve_bench import summary_lines
path, out, ngpu = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
data = json.loads(path.read_text()) if path.is_file() else {}
build = (out / "build.out").read_text().strip().splitlines() if (out / "build.out").is_file() else []
try:
    data["model"] = json.loads(build[-1])
except (IndexError, ValueError):
    data["model"] = {"error": "\n".join(build[-5:])}
smi = shutil.which("nvidia-smi")
gpus = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.splitlines() if smi and ngpu else []
data["host"] = {"gpus": gpus, "phases": (out / "phases.log").read_text().splitlines()}
path.write_text(json.dumps(data, indent=2) + "\n")
if ngpu:  # GPU figures are kept in the repository; a CPU dry run stays in $OUT
    (Path("ops/results") / path.name).write_text(json.dumps(data, indent=2) + "\n")
print("\n".join(summary_lines(data)))
EOF
echo "DONE total_s=$((SECONDS - START))"
