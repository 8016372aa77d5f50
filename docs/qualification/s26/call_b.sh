#!/usr/bin/env bash
# Session 26, device call B: kv-lookup on the machine's 16 cores (issue 22), main's index
# (lookup-bins26/lookup-bench-main26, kv-lookup of 6ec9d8b) against the entry-point index
# (lookup-bench-entry26, branch lookup-entry-points): the single-threaded rows twice each,
# alternating, then the concurrent rows of each; then the GPU work of call A in the time
# left (transfer bench, then every GPU test binary). Carry .bundle-b (.bundle less the wheel and pytest wheels, to fit the carry; gpu-bundle --with-tests
# at 6ec9d8b) and lookup-bins26; results in $OUT/b.tar.gz.
set -u
TS=$(date +%s)
R=$OUT/b; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat /sys/kernel/mm/transparent_hugepage/enabled; } > $R/machine.txt 2>&1
B=lookup-bins26/lookup-bench
TR=data/traces/mooncake_conversation_trace.jsonl
for r in 1 2; do for v in main26 entry26; do
  timeout 60 $B-$v --only single --trace $TR --json $R/single-$v-$r.json > $R/single-$v-$r.log 2>&1
  echo "single $v $r rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
done; done
(cd $OUT && tar czf b-first.tar.gz b)
for v in entry26 main26; do
  timeout 150 $B-$v --only concurrent --threads 1+1,8+8,12+4 --seconds 2 --trace $TR --json $R/concurrent-$v.json > $R/concurrent-$v.log 2>&1
  echo "concurrent $v rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
  (cd $OUT && tar czf b-first.tar.gz b)
done
bash .bundle-b/run.sh --help > /dev/null 2>&1
LEFT=$(( 585 - ( $(date +%s) - TS ) ))
if [ $LEFT -gt 50 ]; then
  timeout 45 bash .bundle-b/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer.json > $R/transfer.log 2>&1
  echo "transfer rc=$?" >> $R/rc.txt
fi
LEFT=$(( 585 - ( $(date +%s) - TS ) ))
if [ $LEFT -gt 40 ]; then
  timeout $((LEFT - 10)) bash .bundle-b/run.sh tests > $R/tests.log 2>&1; echo "tests rc=$?" >> $R/rc.txt
fi
echo "total $(( $(date +%s) - TS )) s" >> $R/rc.txt
cd $OUT && tar czf b.tar.gz b && rm -rf b b-first.tar.gz
