#!/usr/bin/env bash
# Session 32, issue 22: the concurrent rows of kv-lookup's bench on the lent machine's 16 cores
# (CPU only), with the lookups-alone baseline T1+0 beside T1+1 (what the event thread costs each
# indexer's lookups), then 8+8 and 12+4. Binary: lookup-bins32/lookup-bench, the stripped
# `cargo bench -p kv-lookup --bench lookup --no-run` binary of main at afd2c7c (carried).
# Results in $OUT/$NAME.tar.gz, NAME=${NAME:-l}.
set -u
NAME=${NAME:-l}
R=$OUT/$NAME; mkdir -p $R
{ nproc; lscpu | grep -E "Model name|L3|Thread|Core|Socket"; cat /sys/kernel/mm/transparent_hugepage/enabled; } > $R/machine.txt 2>&1
timeout ${H:-300} lookup-bins32/lookup-bench --only concurrent --threads 1+0,1+1,8+8,12+4 --seconds 2 \
  --trace data/traces/mooncake_conversation_trace.jsonl --json $R/concurrent-32.json > $R/concurrent-32.log 2>&1
echo "concurrent rc=$?" >> $R/rc.txt
cd $OUT && tar czf $NAME.tar.gz $NAME && rm -rf $NAME
