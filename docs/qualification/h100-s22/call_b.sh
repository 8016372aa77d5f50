#!/usr/bin/env bash
# Session 22, device call B: the scattered gather's host work per fetch (issue
# 19; branch xfer-host, merged as 475eecb: rows packed with the TransferPlan,
# deliver's host work O(1)) against the kvq of 6ee00ce (main before the merge),
# alternated on one machine lease: `kvq bench transfer --profile gpu --repeats
# 10`, default upload (pipelined2) for both, then the new build once with
# KV_GATHER_UPLOAD=params; and the kv-transfer GPU tests (every upload variant,
# placements). Carry .bundle (gpu-bundle --with-tests at 475eecb) and
# lookup-bins/kvq-6ee00ce.gz. Results tarred into $OUT/b.tar.gz.
set -u
R=$OUT/b; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv; nproc; } > $R/machine.txt 2>&1
bash .bundle/run.sh --help > /dev/null 2>&1  # unpacks exe/
cp .bundle/exe/kvq /tmp/kvq-new
gunzip -c lookup-bins/kvq-6ee00ce.gz > /tmp/kvq-base && chmod +x /tmp/kvq-base
run() {  # run NAME BINARY [env...]
  local name=$1 bin=$2; shift 2
  cp "$bin" .bundle/exe/kvq
  env "$@" timeout 80 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/t-$name.json > $R/t-$name.log 2>&1
  echo "$name rc=$?" >> $R/rc.txt
}
run base-1 /tmp/kvq-base
run new-1 /tmp/kvq-new
run base-2 /tmp/kvq-base
run new-2 /tmp/kvq-new
run new-params /tmp/kvq-new KV_GATHER_UPLOAD=params
cp /tmp/kvq-new .bundle/exe/kvq
timeout 120 bash .bundle/run.sh tests > $R/gpu_tests.log 2>&1
echo "tests rc=$?" >> $R/rc.txt
cd $OUT && tar czf b.tar.gz b && rm -rf b
