#!/usr/bin/env bash
# Session 20, planned device call E (one H200, its 16 cores; no GPU used):
# kv-lookup's concurrent rows before and after the combined event writers
# (d98feb0), alternated twice, with the command of the session-7/19 runs but
# --only concurrent (the single-threaded rows did not change).
#
# Build both binaries here first (x86-64, stripped), into .bundle/:
#   git worktree add /tmp/lk-before dcebd6e
#   (cd /tmp/lk-before && cargo bench -p kv-lookup --bench lookup --no-run)  # prints the binary path
#   cp <that binary> .bundle/lookup-bench-before && strip .bundle/lookup-bench-before
#   cargo xtask gpu-bundle   # .bundle/lookup-bench is the current tree's
# Carry .bundle and data/traces/mooncake_conversation_trace.jsonl; results are
# tarred into $OUT/e.tar.gz (the device tool returns few files).
set -u
R=$OUT/e; mkdir -p $R
nproc > $R/nproc.txt
for run in 1 2; do
  for v in before after; do
    bin=.bundle/lookup-bench; [ $v = before ] && bin=.bundle/lookup-bench-before
    timeout 140 $bin --only concurrent --threads 1+1,4+4,8+8,12+4 --seconds 2 \
      --trace data/traces/mooncake_conversation_trace.jsonl \
      --json $R/$v-$run.json > $R/$v-$run.log 2>&1
    echo "$v run $run rc=$?" >> $R/rc.txt
  done
done
cd $OUT && tar czf e.tar.gz e && rm -rf e
