#!/usr/bin/env bash
# Session 27, device call F (issue 19), right after call E on the same warm machine: the
# pipelined2 first-chunk size (KV_GATHER_PIPELINE_FIRST_KIB 16/32/48 MiB) and growth 1,
# alternated over two rounds. Carry .bundle-e (as call E). Results in $OUT/f.tar.gz.
set -u
TS=$(date +%s)
R=$OUT/f; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; } > $R/machine.txt 2>&1
for r in 1 2; do
  for v in 16384:4 32768:4 49152:4 8192:1 32768:1; do
    first=${v%:*}; growth=${v#*:}
    KV_GATHER_UPLOAD=pipelined2 KV_GATHER_PIPELINE_FIRST_KIB=$first KV_GATHER_PIPELINE_GROWTH=$growth \
      timeout 40 bash .bundle-e/run.sh bench transfer --profile gpu --repeats 10 \
      --json $R/transfer-f$first-g$growth-$r.json > $R/transfer-f$first-g$growth-$r.log 2>&1
    echo "transfer f$first g$growth $r rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
  done
done
echo "total $(( $(date +%s) - TS )) s" >> $R/rc.txt
cd $OUT && tar czf f.tar.gz f && rm -rf f
