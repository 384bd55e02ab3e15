#!/usr/bin/env bash
# CI: compile and link the fused LayerNorm-Modulate op on a CPU-only machine through the user-facing
# prebuild path (DS_BUILD_OPS=1 pip install --no-build-isolation .), in a throwaway venv with torch
# 2.14.1 (CUDA 13.0 build) and the machine's nvcc, then check what can be checked without a GPU driver.
#   bash .ci/build_op.sh            # fresh venv in a temp dir, removed afterwards
#   CI_VENV=/path bash .ci/build_op.sh   # reuse (or create) a venv there, kept
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TORCH_VER=${TORCH_VER:-2.14.1}
DS_VER=${DS_VER:-0.19.8}
start=$(date +%s)

# CUDA_HOME: the toolkit root whose lib64 holds libcudart.so. `nvcc` on PATH may be a wrapper script,
# from which torch guesses the root wrongly (then the link fails with "cannot find -lcudart").
find_cuda_home() {
  local c
  for c in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")" \
           $(grep -ho '/[^ "]*/bin/nvcc' "$(command -v nvcc || echo /dev/null)" 2>/dev/null | sed 's#/bin/nvcc##') \
           /usr/local/cuda /usr/local/cuda-*; do
    if [[ -n "$c" && -x "$c/bin/nvcc" && -e "$c/lib64/libcudart.so" ]]; then echo "$c"; return 0; fi
  done
  return 1
}
CUDA_HOME=$(find_cuda_home) || { echo "FAIL: no CUDA toolkit with bin/nvcc and lib64/libcudart.so"; exit 1; }
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
echo "CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*'))"

if [[ -n "${CI_VENV:-}" ]]; then VENV=$CI_VENV; else TMP=$(mktemp -d); VENV=$TMP/venv; trap 'rm -rf "$TMP"' EXIT; fi
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VER')" 2>/dev/null \
  || "${PIP[@]}" "torch==$TORCH_VER"
"${PIP[@]}" ninja numpy setuptools wheel
# DeepSpeed's sdist imports torch in its setup.py: build it against the torch already in the venv.
"$PY" -c "import deepspeed" 2>/dev/null || "${PIP[@]}" --no-build-isolation "deepspeed==$DS_VER"
echo "venv ready after $(( $(date +%s) - start )) s"

# The user-facing prebuild: no GPU here, so the builder's default arch list (8.0;9.0) applies unless
# TORCH_CUDA_ARCH_LIST is set by the caller.
DS_BUILD_OPS=1 MAX_JOBS=${MAX_JOBS:-2} "${PIP[@]}" --no-build-isolation --no-deps "$ROOT"
echo "built after $(( $(date +%s) - start )) s"

SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
SO=$(ls "$SITE"/ds_adaptiveload/ops/ln_modulate_op*.so)
echo "extension: $SO"
test -f "$SITE/ds_adaptiveload/ops/csrc/ln_modulate.cpp" || { echo "FAIL: sources not shipped as package data"; exit 1; }
syms=$(nm -D --defined-only "$SO")  # not piped into grep -q: with pipefail, nm's SIGPIPE would fail the check
grep -q ' PyInit_ln_modulate_op$' <<<"$syms" || { echo "FAIL: no PyInit_ln_modulate_op"; exit 1; }
# The kernel-choice setters are bench-only (ops/builder.TUNING_ENV): the shipped module must not define them.
! grep -q '_set_tuning' <<<"$(strings "$SO")" || { echo "FAIL: the shipped module has the bench-only _set_tuning"; exit 1; }
# Device code for the requested targets is embedded (cuobjdump may be missing: then skip that check).
if command -v cuobjdump >/dev/null; then
  archs=$(cuobjdump --list-elf "$SO" | grep -o 'sm_[0-9a-z]*' | sort -u | tr '\n' ' ' || true)
  echo "embedded cubins: $archs"
  [[ "$archs" == *sm_90* ]] || { echo "FAIL: no sm_90 cubin"; exit 1; }
  res=$(cuobjdump --dump-resource-usage "$SO")
  grep -q 'fwd_vec_kernel' <<<"$res" || { echo "FAIL: kernels missing"; exit 1; }
fi
TORCH_LIB=$("$PY" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
missing=$(LD_LIBRARY_PATH="$TORCH_LIB:$CUDA_HOME/lib64" ldd "$SO" | grep 'not found' | grep -v 'libcuda\.so' || true)
[[ -z "$missing" ]] || { echo "FAIL: unresolved libraries:"; echo "$missing"; exit 1; }
# Import needs no GPU driver: the CUDA runtime is loaded lazily. Run outside the checkout so the
# installed package (not ./ds_adaptiveload) is imported.
(cd / && "$PY" - <<'PYEOF'
import torch
from ds_adaptiveload.ops.builder import LNModulateBuilder
mod = LNModulateBuilder().prebuilt()
assert mod is not None, "prebuilt module did not import"
assert hasattr(mod, "forward") and hasattr(mod, "backward")
print("import ok:", mod.__file__, "built for torch", mod.torch_version, "| cuda available:", torch.cuda.is_available())
import argparse
from ds_adaptiveload.ops import report
report.run(argparse.Namespace())
PYEOF
)
echo "OK: ln_modulate op compiled, linked and imported in $(( $(date +%s) - start )) s"
