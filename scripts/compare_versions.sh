#!/usr/bin/env bash
# Time one command on the code before a change and on this checkout, alternated on one GPU.
#
#   bash scripts/compare_versions.sh BEFORE ROUNDS COMMAND...
#
# BEFORE is a directory holding the earlier code's tandem/ and benchmarks/, for example
#   mkdir -p before && git archive <commit> tandem benchmarks | tar -x -C before
# COMMAND runs ROUNDS times from BEFORE and from this checkout in turn (before first). It runs
# from each tree's own directory: `python -m` puts the working directory first on sys.path, so a
# tree merely put on PYTHONPATH would be shadowed by the checkout. Each run prints the tandem it
# imported and the lines of its output matching $MATCH (default: the result lines of offline.py
# and latency.py); whole logs go to $LOG_DIR/compare-{before,after}-N.log.
set -uo pipefail
[ $# -ge 3 ] || { sed -n '2,13p' "$0"; exit 2; }
cd "$(dirname "$0")/.."
before=$(cd "$1" && pwd) || exit 2
rounds=$2
shift 2
[ -d "$before/tandem" ] || { echo "$before has no tandem/"; exit 2; }
LOG_DIR=${LOG_DIR:-gpu-logs}
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
MATCH=${MATCH:-'^tandem |^TPOT|tok/s'}
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
after=$PWD
status=0
for round in $(seq 1 "$rounds"); do
  for version in before after; do
    tree=$before
    [ "$version" = after ] && tree=$after
    log="$LOG_DIR/compare-$version-$round.log"
    (cd "$tree" && python3 -c "import tandem; print('tandem from', tandem.__path__[0])" && "$@") > "$log" 2>&1 \
      || { echo "=== $version $round FAILED (see $log)"; status=1; }
    echo "=== $version $round: $(head -n 1 "$log")"
    grep -E "$MATCH" "$log" | head -n 8
  done
done
exit $status
