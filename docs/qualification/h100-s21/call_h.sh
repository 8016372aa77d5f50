#!/usr/bin/env bash
# Session 21, device call H (not run; one H200, after F and G on the same lease):
# gpu_serving with the harness defaults (prompt staged, no advise busy poll),
# the configuration an operator gets without tuning. Carry .bundle; results
# are tarred into $OUT/h.tar.gz.
set -u
R=$OUT/h; mkdir -p $R
KVQ_GPU_SERVING_ARGS="--budget-s 230" timeout 290 bash .bundle/run.sh qualify --profile gpu --only gpu_serving \
  --out $R/default > $R/default.log 2>&1
echo "default rc=$?" >> $R/rc.txt
rm -f $R/default/*.svg
cd $OUT && tar czf h.tar.gz h && rm -rf h
