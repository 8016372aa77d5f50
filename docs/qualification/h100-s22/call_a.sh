#!/usr/bin/env bash
# Session 22, device call A (planned for an H200, ran on an H100; COMMANDS.md): (1) what one torch.cuda.memory_allocated read costs
# (the prefill worker read it twice inside each timed ON, never in OFF, until
# this session); (2) advise_rpc_probe.py: is a pipe request right after a
# router-service advise slower than one after nothing or after a sleep of the
# same length (no torch); (3) gpu_serving, GPU profile (now with
# --first-turn-repeats 5 and no device-memory reads inside ON), advise busy
# poll on at both ends as in session 19's call C. Carry .bundle; results are
# tarred into $OUT/a.tar.gz. A_EXTRA: more harness arguments.
set -u
R=$OUT/a; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep -E "Model name|Thread|Core|Socket"; } > $R/machine.txt 2>&1
timeout 60 python3 xtask/gpu/device_bytes_cost.py > $R/device_bytes_cost.json 2> $R/device_bytes_cost.err
bash .bundle/run.sh --help > /dev/null 2>&1  # unpacks the bundle (harness, wheel, router, nats-server)
PYTHONPATH=$PWD/.bundle/python timeout 120 python3 xtask/gpu/advise_rpc_probe.py \
  --router-bin .bundle/exe/kv-reuse-router --nats-server .bundle/bin/nats-server \
  --rounds 40 --gap-ms 30 --json $R/probe.json > $R/probe.log 2>&1
echo "probe rc=$?" >> $R/rc.txt
KVQ_GPU_SERVING_ARGS="--advise-busy-poll-us 1000000 ${A_EXTRA:-}" \
  timeout 430 bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $R/serving > $R/serving.log 2>&1
echo "serving rc=$?" >> $R/rc.txt
rm -f $R/serving/*.svg
cd $OUT && tar czf a.tar.gz a && rm -rf a
