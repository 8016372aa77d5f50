#!/usr/bin/env bash
# Session 26, device call C: a second sample of kv-lookup's T1+E1 rows on the 16 cores
# (issue 22), the entry-point index (lookup-bins26/lookup-bench-entry26) and main's index
# (lookup-bench-main26) alternated twice; call B ran each once with T1+E1, T8+E8, T12+E4.
# Then, on an H200, the gather's four block-table upload variants (KV_GATHER_UPLOAD, issue 19:
# the 1024 x 64 KiB kernel runs at the copy limit there, the row does not), one transfer
# bench each, default first. Carry lookup-bins26 and .bundle-b (see call_b.sh); results in
# $OUT/c.tar.gz.
set -u
TS=$(date +%s)
R=$OUT/c; mkdir -p $R
{ nproc; lscpu | grep -E "Model name|L3"; } > $R/machine.txt 2>&1
B=lookup-bins26/lookup-bench
TR=data/traces/mooncake_conversation_trace.jsonl
for r in 1 2; do for v in entry26 main26; do
  timeout 90 $B-$v --only concurrent --threads 1+1 --seconds 2 --trace $TR --json $R/t1e1-$v-$r.json > $R/t1e1-$v-$r.log 2>&1
  echo "t1e1 $v $r rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
done; done
(cd $OUT && tar czf c.tar.gz c)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } >> $R/machine.txt 2>&1
if grep -q H200 $R/machine.txt; then
  bash .bundle-b/run.sh --help > /dev/null 2>&1
  for u in pipelined2 params pipelined copy; do
    KV_GATHER_UPLOAD=$u timeout 45 bash .bundle-b/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer-$u.json > $R/transfer-$u.log 2>&1
    echo "transfer $u rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
  done
fi
cd $OUT && tar czf c.tar.gz c && rm -rf c
