#!/usr/bin/env bash
# Session 23, device call A (asked of an H200): (1) kvq bench transfer --profile gpu
# twice (issue 19's ratios against a raw copy of the same bytes in the same run);
# (2) gpu_serving, GPU profile, the full workload (8 sessions x 6 turns to 32K,
# churn and warm regimes, router service, busy poll at both ends as in session
# 19's call C; issue 21). Carry .bundle (cargo xtask gpu-bundle); results are
# tarred into $OUT/a.tar.gz. A_EXTRA: more harness arguments.
set -u
R=$OUT/a; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep -E "Model name|Thread|Core|Socket"; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1  # unpacks the bundle once
for i in 1 2; do
  timeout 60 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer-$i.json > $R/transfer-$i.log 2>&1
  echo "transfer $i rc=$?" >> $R/rc.txt
done
KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 ${A_EXTRA:-}" \
  timeout ${A_SERVING_S:-460} bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/serving > $R/serving.log 2>&1
echo "serving rc=$?" >> $R/rc.txt
rm -f $R/serving/*.svg
cd $OUT && tar czf a.tar.gz a && rm -rf a
