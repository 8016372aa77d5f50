#!/usr/bin/env bash
# Session 24, device call A (one H200, asked with needs_h200: the full workload's
# two regimes at 8 sessions do not fit an 80 GB card, session 23 call A):
# (1) gpu_serving, the issue-21 workload (8 sessions x 6 turns to 32K) in both
# regimes, advise busy poll on at both ends as in every serving record since
# session 18; (2) kvq bench transfer --profile gpu three times (issue 19's
# ratios, unmeasured on an H200 since session 19); (3) every GPU test binary.
# Carry .bundle (cargo xtask gpu-bundle --with-tests); results are tarred into
# $OUT/a.tar.gz (a-serving.tar.gz first, in case the rest runs past the limit).
set -u
R=$OUT/a; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name"; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1  # unpacks the bundle once
( while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done ) > $R/memory_used_mib.txt 2>&1 &
MON=$!
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
REGIME=churn; [ "${MIB:-0}" -gt 100000 ] && REGIME=both
echo "memory.total ${MIB} MiB: --regime $REGIME" >> $R/rc.txt
KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 --regime $REGIME" \
  timeout 330 bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/serving > $R/serving.log 2>&1
echo "serving rc=$?" >> $R/rc.txt
kill $MON
rm -f $R/serving/*.svg
(cd $OUT && tar czf a-serving.tar.gz a)
for i in 1 2 3; do
  timeout 60 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer-$i.json > $R/transfer-$i.log 2>&1
  echo "transfer $i rc=$?" >> $R/rc.txt
done
timeout 150 bash .bundle/run.sh tests > $R/tests.log 2>&1; echo "tests rc=$?" >> $R/rc.txt
cd $OUT && tar czf a.tar.gz a && rm -rf a
