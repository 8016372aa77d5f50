#!/usr/bin/env bash
# Session 27, device call E (issue 19): the gather's block-table upload variants
# (KV_GATHER_UPLOAD) and two pipeline first-chunk sizes, `kvq bench transfer --profile gpu
# --repeats 10` each, alternated over two rounds, on whatever card comes (the variants are
# compared within this call; the card is in machine.txt). Session 26's call D, refused twice,
# was the H200-only version. Carry .bundle-e: hard links of .bundle's run.sh, build-info.json,
# data, exe and nixl-libs archives (transfer code unchanged since that bundle's 6ec9d8b).
# Results in $OUT/e.tar.gz.
set -u
TS=$(date +%s)
R=$OUT/e; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > $R/machine.txt 2>&1
bash .bundle-e/run.sh --help > /dev/null 2>&1
for r in 1 2; do
  for u in pipelined2 params pipelined copy first32M; do
    case $u in
      first32M) env="KV_GATHER_UPLOAD=pipelined2 KV_GATHER_PIPELINE_FIRST_KIB=32768" ;;
      *) env="KV_GATHER_UPLOAD=$u" ;;
    esac
    env $env timeout 40 bash .bundle-e/run.sh bench transfer --profile gpu --repeats 10 \
      --json $R/transfer-$u-$r.json > $R/transfer-$u-$r.log 2>&1
    echo "transfer $u $r rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
  done
done
echo "total $(( $(date +%s) - TS )) s" >> $R/rc.txt
cd $OUT && tar czf e.tar.gz e && rm -rf e
