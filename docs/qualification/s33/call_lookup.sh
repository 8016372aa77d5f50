#!/usr/bin/env bash
# Session 33, issue 22: kv-lookup's `--only interference` rows on the lent machine's 16 cores (CPU
# only): each indexer's lookups (T1) under one event thread writing another index, against its own
# (lookup/interference.rs). Binary: lookup-bins33/lookup-bench, the stripped
# `cargo bench -p kv-lookup --bench lookup --no-run` binary of this commit (carried).
# Results in $OUT/$NAME.tar.gz, NAME=${NAME:-i}.
set -u
NAME=${NAME:-i}
R=$OUT/$NAME; mkdir -p $R
{ nproc; lscpu | grep -E "Model name|L3|Thread|Core|Socket"; cat /sys/kernel/mm/transparent_hugepage/enabled;
  cat /sys/devices/system/clocksource/clocksource0/current_clocksource; } > $R/machine.txt 2>&1
for run in 1 2; do
  timeout ${T:-120} lookup-bins33/lookup-bench --only interference --threads 1+1 --seconds 2 \
    > $R/interference-$run.log 2>&1
  echo "interference-$run rc=$?" >> $R/rc.txt
done
cd $OUT && tar czf $NAME.tar.gz $NAME && rm -rf $NAME
