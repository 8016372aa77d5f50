#!/usr/bin/env bash
# Session 28, device call D: call C cut to what fits a short device budget (329 s were left after
# 14 refused starts): the full `qualify --profile gpu` does not fit, its GPU sections but
# gpu_serving and cluster do. Bundle as call C (.bundle-c28: `cargo xtask gpu-bundle
# --with-tests` at b1fa715) and lookup-bins28. In order, each step only while time is left:
#  1. issue 19: the GPU test session 27 changed (`every_upload_variant_lands_every_byte_of_a_
#     scattered_fetch`), then `kvq bench transfer --profile gpu --repeats 10` at the 16 MiB
#     default and at 8 MiB, alternated twice;
#  2. `qualify --profile gpu` sections bank_cuda_ipc, transfer_cuda_ipc, transfer_oracle,
#     transfer_oracle_nixl, faults;
#  3. every GPU test binary;
#  4. issue 22: kv-lookup's `--only concurrent --threads 1+1 --seconds 2` on the 16 cores.
# H: seconds this call may run. Results in $OUT/d.tar.gz (d-first.tar.gz after each step).
set -u
H=${H:-250}
TS=$(date +%s)
R=$OUT/d; mkdir -p $R
B=.bundle-c28
el() { echo $(( $(date +%s) - TS )); }
snap() { (cd $OUT && tar czf d-first.tar.gz d); }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu | grep -E "Model name|L3"; cat $B/build-info.json; command -v ip nats-server; } > $R/machine.txt 2>&1
bash $B/run.sh --help > /dev/null 2>&1
for t in $B/tests/gpu-*; do
  timeout 60 "$t" every_upload_variant --nocapture --test-threads=1 >> $R/gpu-test-upload.log 2>&1
  echo "$(basename $t) every_upload_variant rc=$? at $(el) s" >> $R/rc.txt
done
for r in 1 2; do
  for first in default 8192; do
    [ $(( H - $(el) )) -gt 25 ] || break 2
    if [ $first = default ]; then env=""; else env="KV_GATHER_PIPELINE_FIRST_KIB=$first"; fi
    env $env timeout 20 bash $B/run.sh bench transfer --profile gpu --repeats 10 \
      --json $R/transfer-$first-$r.json > $R/transfer-$first-$r.log 2>&1
    echo "transfer $first $r rc=$? at $(el) s" >> $R/rc.txt
  done
done
snap
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 60 ]; then
  timeout $(( LEFT > 110 ? 90 : LEFT - 15 )) bash $B/run.sh qualify --profile gpu --only bank_cuda_ipc --only transfer_cuda_ipc \
    --only transfer_oracle --only transfer_oracle_nixl --only faults --out $R/qualify > $R/qualify.log 2>&1
  echo "qualify (GPU sections) rc=$? at $(el) s" >> $R/rc.txt; snap
fi
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 40 ]; then
  timeout $(( LEFT > 80 ? 60 : LEFT - 15 )) bash $B/run.sh tests > $R/tests.log 2>&1
  echo "tests rc=$? at $(el) s" >> $R/rc.txt; snap
fi
LEFT=$(( H - $(el) ))
if [ $LEFT -gt 45 ]; then
  timeout $(( LEFT - 10 )) lookup-bins28/lookup-bench-main28 --only concurrent --threads 1+1 --seconds 2 \
    --trace data/traces/mooncake_conversation_trace.jsonl --json $R/concurrent-main28.json > $R/concurrent-main28.log 2>&1
  echo "concurrent main28 (1+1) rc=$? at $(el) s" >> $R/rc.txt
fi
echo "total $(el) s" >> $R/rc.txt
cd $OUT && tar czf d.tar.gz d && rm -rf d d-first.tar.gz
