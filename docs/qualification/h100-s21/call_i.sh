#!/usr/bin/env bash
# Session 21, device call I (one H100 or H200, its 16 cores; no GPU used):
# kv-lookup's bench, single-threaded and concurrent rows, with main's code
# (lookup-bins/lookup-bench, built at d98feb0) and with the chunk skip of
# branch lookup-skip (lookup-bins/lookup-bench-skip), one run each, skip
# first. Carry lookup-bins and data/traces/mooncake_conversation_trace.jsonl
# (tracked); results are tarred into $OUT/i.tar.gz.
set -u
R=$OUT/i; mkdir -p $R
nproc > $R/nproc.txt
for v in skip main; do
  bin=lookup-bins/lookup-bench-$v; [ $v = main ] && bin=lookup-bins/lookup-bench
  timeout 210 $bin --threads 1+1,8+8,12+4 --seconds 2 \
    --trace data/traces/mooncake_conversation_trace.jsonl --json $R/lookup-$v.json > $R/lookup-$v.log 2>&1
  echo "lookup $v rc=$?" >> $R/rc.txt
done
cd $OUT && tar czf i.tar.gz i && rm -rf i
