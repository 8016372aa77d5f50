#!/usr/bin/env bash
# Session 33, issue 22: `--only interference --threads 1+1` of two stripped bench binaries,
# alternated (main, pad, main, pad): lookup-bins33/lookup-bench (kv-lookup of 0c9b374) and
# lookup-bins33/lookup-pad (the same with the fields lookups read on cache lines apart from
# those mutations write, the published pointer apart from the writer's state: kv-lookup's
# cache_line.rs). Results in $OUT/$NAME.tar.gz, NAME=${NAME:-p}.
set -u
NAME=${NAME:-p}
R=$OUT/$NAME; mkdir -p $R
{ nproc; lscpu | grep -E "Model name|L3"; cat /sys/devices/system/clocksource/clocksource0/current_clocksource; } > $R/machine.txt 2>&1
for run in 1 2; do
  for b in lookup-bench lookup-pad; do
    timeout ${T:-90} lookup-bins33/$b --only interference --threads 1+1 --seconds 2 > $R/$b-$run.log 2>&1
    echo "$b-$run rc=$?" >> $R/rc.txt
  done
done
cd $OUT && tar czf $NAME.tar.gz $NAME && rm -rf $NAME
