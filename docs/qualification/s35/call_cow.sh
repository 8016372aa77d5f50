#!/usr/bin/env bash
# Session 35, issue 22: runs shared by both left-right copies (copy on write; branch `cow35`,
# commit cb7759b) against main, on the lent machine's 16 cores (CPU only). Not run in session 35:
# no machine was lent. Binaries (carried, ignored dir lookup-bins35/), each the
# `cargo bench -p kv-lookup --bench lookup --no-run` binary, `objcopy --strip-debug`:
#   lookup-main: main at 4f58ba3 plus the bench's resident-memory note (the commit adding this file);
#   lookup-cow:  branch cow35 at cb7759b.
# Build them with a target dir per worktree (one shared target dir let cargo take one worktree's
# artifact for the other's). The two alternate, so a host whose speed drifts shows it in both.
# Call: run(command="NAME=c bash docs/qualification/s35/call_cow.sh", carry=["lookup-bins35"]).
# Results in $OUT/$NAME.tar.gz, NAME=${NAME:-c}.
set -u
NAME=${NAME:-c}
R=$OUT/$NAME; mkdir -p $R
{ nproc; lscpu | grep -E "Model name|L2|L3|Thread|Core|Socket"; cat /sys/kernel/mm/transparent_hugepage/enabled;
  cat /sys/devices/system/clocksource/clocksource0/current_clocksource; } > $R/machine.txt 2>&1
for round in 1 2; do
  for b in main cow; do
    timeout ${T:-120} lookup-bins35/lookup-$b --only interference --threads 1+1 --seconds 2 \
      > $R/interference-$b-$round.log 2>&1
    echo "interference-$b-$round rc=$? $(date +%T)" >> $R/rc.txt
  done
done
for b in main cow; do
  timeout ${H:-150} lookup-bins35/lookup-$b --only concurrent --threads 1+0,1+1,8+8 --seconds 2 \
    --trace data/traces/mooncake_conversation_trace.jsonl --json $R/concurrent-$b.json > $R/concurrent-$b.log 2>&1
  echo "concurrent-$b rc=$? $(date +%T)" >> $R/rc.txt
done
cd $OUT && tar czf $NAME.tar.gz $NAME && rm -rf $NAME
