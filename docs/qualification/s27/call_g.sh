#!/usr/bin/env bash
# Session 27, device call G (issue 19): the committed code's bundle (`cargo xtask gpu-bundle
# --with-tests` after the 16 MiB first-chunk change): kv-transfer's GPU test
# `every_upload_variant_lands_every_byte_of_a_scattered_fetch` (binary `gpu-*`; it asserts one
# launch for an 11.7 MiB fetch at the new default and two at an explicit 8 MiB first chunk,
# every byte of every upload variant; the only GPU test this session changed), then `kvq bench transfer --profile
# gpu --repeats 10` at the default and at KV_GATHER_PIPELINE_FIRST_KIB=8192, alternated twice.
# Carry .bundle-g (.bundle's run.sh, build-info.json, data, exe, nixl-libs, tests). Results in
# $OUT/g.tar.gz.
set -u
TS=$(date +%s)
R=$OUT/g; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; cat .bundle-g/build-info.json; } > $R/machine.txt 2>&1
bash .bundle-g/run.sh --help > /dev/null 2>&1
for t in .bundle-g/tests/gpu-*; do
  timeout 60 "$t" every_upload_variant --nocapture --test-threads=1 > $R/gpu-tests.log 2>&1
  echo "gpu tests rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
done
for r in 1 2; do
  for first in default 8192; do
    if [ $first = default ]; then env=""; else env="KV_GATHER_PIPELINE_FIRST_KIB=$first"; fi
    env $env timeout 30 bash .bundle-g/run.sh bench transfer --profile gpu --repeats 10 \
      --json $R/transfer-$first-$r.json > $R/transfer-$first-$r.log 2>&1
    echo "transfer $first $r rc=$? at $(( $(date +%s) - TS )) s" >> $R/rc.txt
  done
done
echo "total $(( $(date +%s) - TS )) s" >> $R/rc.txt
cd $OUT && tar czf g.tar.gz g && rm -rf g
