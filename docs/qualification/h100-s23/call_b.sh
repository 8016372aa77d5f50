#!/usr/bin/env bash
# Session 23, device call B (asked of an H200; an H100 came for call A): gpu_serving with
# the full workload's churn regime, 8 sessions x 6 turns to 32K (issue 21), now
# that the decode keeps idle sessions' KV on the host where the card is too
# small (--decode-cache auto chooses it on 79 GiB); advise busy poll on at both
# ends as in the earlier records. Carry .bundle (cargo xtask gpu-bundle);
# results are tarred into $OUT/b.tar.gz. B_EXTRA: more harness arguments.
set -u
R=$OUT/b; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep -E "Model name|Thread|Core|Socket"; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1  # unpacks the bundle once
( while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done ) > $R/memory_used_mib.txt 2>&1 &
MON=$!
# An H200 (141 GB) runs both regimes, the full workload; an 80 GB card the churn regime.
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
REGIME=churn; [ "${MIB:-0}" -gt 100000 ] && REGIME=both
echo "memory.total ${MIB} MiB: --regime $REGIME" >> $R/rc.txt
KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 --regime $REGIME ${B_EXTRA:-}" \
  timeout ${B_SERVING_S:-430} bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/serving > $R/serving.log 2>&1
echo "serving rc=$?" >> $R/rc.txt
kill $MON
rm -f $R/serving/*.svg
(cd $OUT && tar czf b-serving.tar.gz b)  # kept even if what follows runs past the call's limit
# Issue 22 on 16 cores, after the serving run: kv-lookup's concurrent rows of main
# before (lookup-bins/lookup-bench-main23, d051e42) and after the session's event-path
# change (lookup-bins/lookup-bench-events23, 6ca6b83), one run each, if carried.
for v in main23 events23; do
  bin=lookup-bins/lookup-bench-$v
  [ -x $bin ] || continue
  timeout 70 $bin --only concurrent --threads 1+1,8+8,12+4 --seconds 2 \
    --trace data/traces/mooncake_conversation_trace.jsonl --json $R/lookup-$v.json > $R/lookup-$v.log 2>&1
  echo "lookup $v rc=$?" >> $R/rc.txt
done
cd $OUT && tar czf b.tar.gz b && rm -rf b
