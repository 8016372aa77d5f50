#!/usr/bin/env bash
# Session 26, device call D (issue 19): on an H200, the gather's four block-table upload
# variants (KV_GATHER_UPLOAD), `kvq bench transfer --profile gpu --repeats 10` each, the
# default (pipelined2) first, twice round. On another card it stops (session 22 compared the
# variants on the H100). Carry .bundle-b (see call_b.sh); results in $OUT/d.tar.gz.
set -u
TS=$(date +%s)
R=$OUT/d; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > $R/machine.txt 2>&1
if grep -q H200 $R/machine.txt; then
  bash .bundle-b/run.sh --help > /dev/null 2>&1
  for r in 1 2; do for u in pipelined2 params pipelined copy; do
    KV_GATHER_UPLOAD=$u timeout 45 bash .bundle-b/run.sh bench transfer --profile gpu --repeats 10 --json $R/transfer-$u-$r.json > $R/transfer-$u-$r.log 2>&1
    echo "transfer $u $r rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
  done; done
fi
cd $OUT && tar czf d.tar.gz d && rm -rf d
