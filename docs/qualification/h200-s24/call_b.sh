#!/usr/bin/env bash
# Session 24, device call B (one H200 lease): the layer-by-layer fetch release
# against the whole-fetch gate, churn regime of the issue-21 workload (8
# sessions x 6 turns to 32K), alternated layers / on / layers on one lease
# (--fetch-overlap layers --layer-groups 8 vs --fetch-overlap on), advise busy
# poll on at both ends. Carry .bundle; results tarred into $OUT/b.tar.gz.
set -u
R=$OUT/b; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1
n=0
for mode in layers on layers; do
  n=$((n+1))
  KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 --regime churn --fetch-overlap $mode" \
    timeout ${B_RUN_S:-175} bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/$n-$mode > $R/$n-$mode.log 2>&1
  echo "$n $mode rc=$?" >> $R/rc.txt
  rm -f $R/$n-$mode/*.svg
  (cd $OUT && tar czf b-$n.tar.gz b)
done
cd $OUT && tar czf b.tar.gz b && rm -rf b
