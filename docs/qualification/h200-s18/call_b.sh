#!/usr/bin/env bash
# Session 19, device call B (one H200): kv-lookup's bench on the machine's 16
# cores with the command of the session-7 run (the session-9 root-slot
# prefetch was never judged there), then the transfer bench with smaller
# first pipeline chunks (does exposing less packing before the first kernel
# lift the scattered rows?). Carry .bundle (with .bundle/lookup-bench).
# Results are tarred into $OUT/b.tar.gz (the device tool returns few files).
set -u
R=$OUT/b; mkdir -p $R
nproc > $R/nproc.txt
timeout 240 .bundle/lookup-bench --threads 1+1,4+4,8+8,12+4 --seconds 2 \
  --trace data/traces/mooncake_conversation_trace.jsonl \
  --json $R/concurrent-16core-s19.json > $R/concurrent-16core-s19.log 2>&1
echo "lookup rc=$?" >> $R/rc.txt
for f in 2048 4096; do
  KV_GATHER_PIPELINE_FIRST_KIB=$f timeout 90 bash .bundle/run.sh bench transfer --profile gpu \
    --repeats 5 --json $R/transfer-first$f.json > $R/transfer-first$f.log 2>&1
  echo "transfer first=$f rc=$?" >> $R/rc.txt
done
KV_GATHER_PIPELINE_GROWTH=2 timeout 90 bash .bundle/run.sh bench transfer --profile gpu \
  --repeats 5 --json $R/transfer-growth2.json > $R/transfer-growth2.log 2>&1
echo "transfer growth=2 rc=$?" >> $R/rc.txt
cd $OUT && tar czf b.tar.gz b && rm -rf b
