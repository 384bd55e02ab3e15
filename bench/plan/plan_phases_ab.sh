#!/usr/bin/env bash
# A/B of packed's planning time: bench/plan/plan_phases.py run in turns on two checkouts (PYTHONPATH set to each), so
# that the machine's load falls on both alike. Writes the "== LABEL, rep N: COMMAND" file that
# `python bench/plan/plan_phases.py --record RAW` reads.
#   bash bench/plan/plan_phases_ab.sh BEFORE_DIR "before (b43ae2c)" REPS RAW CLIPSxG...
#   git worktree add /tmp/before b43ae2c
#   AFTER_LABEL="after (8a5f93e)" bash bench/plan/plan_phases_ab.sh /tmp/before "before (b43ae2c)" 2 RAW 1x1 1x4 6x1
# The second checkout is this one, labelled $AFTER_LABEL (default "this code"; a label already in results.csv for the
# same case would be overwritten by --record).
set -euo pipefail
[ $# -ge 5 ] || { sed -n 2,9p "$0" >&2; exit 2; }
before=$(cd "$1" && pwd) label=$2 reps=$3 raw=$(realpath -m "$4")
shift 4
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python}
: > "$raw"
for rep in $(seq 1 "$reps"); do
  for case in "$@"; do
    clips=${case%x*} g=${case#*x}
    cmd="nice -n 10 python bench/plan/plan_phases.py --clips $clips --g $g"
    for side in "$label|$before" "${AFTER_LABEL:-this code}|$here"; do
      echo "== ${side%%|*}, rep $rep: $cmd" >> "$raw"
      (cd "${side#*|}" && PYTHONPATH="${side#*|}" nice -n 10 "$py" "$here/bench/plan/plan_phases.py" \
        --clips "$clips" --g "$g" >> "$raw")
    done
  done
done
