#!/usr/bin/env bash
# Session 23, device call C: (1) every GPU test binary (kv-transfer's PartPlan
# fields became private accessors since the last GPU test run); (2) kvq bench
# transfer --profile gpu once; (3) kv-lookup's concurrent rows before
# (lookup-bins/lookup-bench-main23, d051e42) and after (lookup-bench-events23,
# 6ca6b83, the kv-lookup of main since cc42d31) with room for every row this
# time (call B cut both at 70 s), events23 first. Carry .bundle (cargo xtask
# gpu-bundle --with-tests) and lookup-bins; results are tarred into $OUT/c.tar.gz.
set -u
R=$OUT/c; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1  # unpacks the bundle once
timeout 150 bash .bundle/run.sh tests > $R/tests.log 2>&1; echo "tests rc=$?" >> $R/rc.txt
timeout 60 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer.json > $R/transfer.log 2>&1
echo "transfer rc=$?" >> $R/rc.txt
(cd $OUT && tar czf c-first.tar.gz c)
for v in events23 main23; do
  timeout 140 lookup-bins/lookup-bench-$v --only concurrent --threads 1+1,8+8,12+4 --seconds 2 \
    --trace data/traces/mooncake_conversation_trace.jsonl --json $R/lookup-$v.json > $R/lookup-$v.log 2>&1
  echo "lookup $v rc=$?" >> $R/rc.txt
done
cd $OUT && tar czf c.tar.gz c && rm -rf c
