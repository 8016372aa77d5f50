#!/bin/bash
# A/B of the concurrent rows on the shared 2-core build VM: main's bench binary
# (kv-lookup at faffb67) and this branch's, alternated, ROUNDS each.
# usage: ab.sh ROUNDS MAIN_BIN NEW_BIN OUT_DIR
set -u
R=$1; MAIN=$2; NEW=$3; OUT=$4
TRACE=/work/wt-events/data/traces/mooncake_conversation_trace.jsonl
for r in $(seq 1 "$R"); do
  for which in main new; do
    bin=$MAIN; [ "$which" = new ] && bin=$NEW
    f="$OUT/$which-run$r"
    echo "# $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): $bin --only concurrent --threads 0+1,1+1 --seconds 2 --trace $TRACE --json $f.json" > "$f.log"
    "$bin" --only concurrent --threads 0+1,1+1 --seconds 2 --trace "$TRACE" --json "$f.json" >> "$f.log" 2>&1
    echo "# done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$f.log"
  done
done
