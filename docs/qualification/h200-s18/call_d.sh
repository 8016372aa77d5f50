#!/usr/bin/env bash
# Session 19, device call D (one H200): gpu_serving twice in one call, the
# advise busy poll off (the default) then on (--advise-busy-poll-us 1000000),
# an A/B on one machine lease for call C's single busy-poll run. Carry .bundle;
# results are tarred into $OUT/d.tar.gz.
set -u
R=$OUT/d; mkdir -p $R
bash .bundle/run.sh --help > /dev/null 2>&1
for v in 0 1000000; do
  KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us $v" timeout 280 bash .bundle/run.sh qualify --profile gpu \
    --only gpu_serving --out $R/bp$v > $R/bp$v.log 2>&1; echo "bp=$v rc=$?" >> $R/rc.txt
  rm -f $R/bp$v/*.svg $R/bp$v/record.json
done
cd $OUT && tar czf d.tar.gz d && rm -rf d
