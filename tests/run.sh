#!/usr/bin/env bash
# Set up (.venv with the test extras) and run the fast test tier, every test (--all), or the test files and pytest
# options given. CUDA tests skip with a reason on a CPU.
#   bash tests/run.sh                                   # the fast tier: every test not marked slow
#   bash tests/run.sh --all                             # every test (what CI runs)
#   bash tests/run.sh tests/test_train.py -x            # these files only, slow tests included
#   bash tests/run.sh --stress tests/test_train.py      # while busy loops compete for every core
#   bash tests/run.sh --stress=4 ...                    # with 4 busy loops (default: one per core)
# --stress: N busy-loop processes at niceness STRESS_NICE (default 10) run for as long as pytest does, so that
# ranks are descheduled at random points, as on a machine shared with other jobs (races show up there first).
set -euo pipefail
cd "$(dirname "$0")/.."
STRESS=0
ALL=0
ARGS=()
for a in "$@"; do
  case "$a" in
    --all) ALL=1 ;;
    --stress) STRESS=$(nproc) ;;
    --stress=*) STRESS=${a#--stress=} ;;
    *) ARGS+=("$a") ;;
  esac
done
[[ $STRESS =~ ^[0-9]+$ ]] || { echo "tests/run.sh: --stress=N needs a number of busy loops, got $STRESS" >&2; exit 2; }
# pytest gets `tests` only when no test path is given (both would run the whole suite).
PATHS=0
for a in ${ARGS[@]+"${ARGS[@]}"}; do
  if [[ $a != -* && -e ${a%%::*} ]]; then PATHS=1; fi
done
if [ "$PATHS" = 0 ]; then
  # slow: multi-process and long tests (tests/conftest.py SLOW_FILES and @pytest.mark.slow)
  if [ "$ALL" = 0 ]; then ARGS=(-m "not slow" ${ARGS[@]+"${ARGS[@]}"}); fi
  ARGS=(tests ${ARGS[@]+"${ARGS[@]}"})
fi
source launch/env.sh test
# DeepSpeed JIT-builds its CPU all-reduce op into torch's extension folder, under a lock file that every process
# loading the op takes; a job killed while holding it leaves the lock, and every later load waits for good
# (seen 2026-12-06: runs of every checkout on the machine hung at start-up). The suite keeps its own folder.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
python tests/warm_ops.py
BUSY=()
stop_busy() { for pid in ${BUSY[@]+"${BUSY[@]}"}; do kill "$pid" 2>/dev/null || true; done; }
trap stop_busy EXIT
for _ in $(seq 1 "$STRESS"); do
  nice -n "${STRESS_NICE:-10}" bash -c 'while :; do :; done' &
  BUSY+=($!)
done
if [ "$STRESS" != 0 ]; then echo "tests/run.sh: $STRESS busy loops at niceness ${STRESS_NICE:-10}" >&2; fi
# A test that hangs fails after TEST_TIMEOUT seconds (pytest-timeout prints every thread's stack), instead of using up
# CI's 90 minutes; -rfE lists every failure and error by name at the end of the output.
# Tests import the installed package; run from the repo root so configs/ and bench/ paths resolve.
# A passed test's tmp_path is deleted when it ends (retention "failed"): the suite's checkpoints and datasets otherwise
# pile up until the run ends.
python -m pytest -q -p no:cacheprovider -rfE --timeout "${TEST_TIMEOUT:-1200}" -o tmp_path_retention_policy=failed \
  "${ARGS[@]}"
