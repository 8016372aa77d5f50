#!/usr/bin/env bash
# Session 30, device call C: call A cut to what fits a short budget, most wanted first (same
# carry: .bundle-a30, lookup-bins30). In order, each step only while time is left (H: seconds):
#  1. issue 19: `kvq bench transfer --profile gpu --repeats 10` at the 16 MiB default, then at
#     KV_GATHER_PIPELINE_FIRST_KIB=8192;
#  2. the GPU test session 27 changed (`every_upload_variant_lands_every_byte_of_a_scattered_fetch`);
#  3. issue 22: kv-lookup's `--only concurrent --threads 1+1 --seconds 2` on the 16 cores.
# Results in $OUT/c.tar.gz (c-first.tar.gz after each step).
set -u
H=${H:-150}
TS=$(date +%s)
R=$OUT/c; mkdir -p $R
B=.bundle-a30
L=lookup-bins30/lookup-bench-30
TR=data/traces/mooncake_conversation_trace.jsonl
el() { echo $(( $(date +%s) - TS )); }
snap() { (cd $OUT && tar czf c-first.tar.gz c); }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; } > $R/machine.txt 2>&1
bash $B/run.sh --help > /dev/null 2>&1
for first in default 8192; do
  LEFT=$(( H - $(el) )); [ $LEFT -gt 20 ] || break
  if [ $first = default ]; then env=""; else env="KV_GATHER_PIPELINE_FIRST_KIB=$first"; fi
  env $env timeout $(( LEFT > 50 ? 40 : LEFT - 10 )) bash $B/run.sh bench transfer --profile gpu --repeats 10 \
    --json $R/transfer-$first.json > $R/transfer-$first.log 2>&1
  echo "transfer $first rc=$? at $(el) s" >> $R/rc.txt; snap
done
for t in $B/tests/*; do
  LEFT=$(( H - $(el) )); [ $LEFT -gt 15 ] || break
  timeout $(( LEFT > 40 ? 30 : LEFT - 5 )) "$t" every_upload_variant --nocapture --test-threads=1 >> $R/gpu-test-upload.log 2>&1
  echo "$(basename $t) every_upload_variant rc=$? at $(el) s" >> $R/rc.txt
done
snap
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 40 ]; then
  timeout $(( LEFT - 10 )) $L --only concurrent --threads 1+1 --seconds 2 --trace $TR --json $R/concurrent-30.json > $R/concurrent-30.log 2>&1
  echo "concurrent 1+1 rc=$? at $(el) s" >> $R/rc.txt
fi
echo "total $(el) s" >> $R/rc.txt
cd $OUT && tar czf c.tar.gz c && rm -rf c c-first.tar.gz
