#!/usr/bin/env bash
# Session 22, device call C (one H100 or H200, its 16 cores): (1) the gather's
# upload variant now that deliver packs nothing: `kvq bench transfer --profile
# gpu --repeats 10` with KV_GATHER_UPLOAD=pipelined2 (default) and params,
# alternated three times each on the bundle's kvq (475eecb); (2) kv-lookup's
# concurrent rows, main (lookup-bins/lookup-bench-main, kv-lookup of faffb67)
# against branch lookup-events (lookup-bins/lookup-bench-new, kv-lookup of
# 8d2317a: per-event replay work cut, plus the batched row), new first; (3) the
# new binary's single-threaded rows with glibc's malloc on huge pages and
# without (GLIBC_TUNABLES=glibc.malloc.hugetlb=1 / 0), and the machine's THP
# mode. Carry .bundle (without its wheel, nats-server and pytest files) and
# lookup-bins. Results tarred into $OUT/c.tar.gz.
set -u
R=$OUT/c; mkdir -p $R
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; cat /sys/kernel/mm/transparent_hugepage/enabled; } > $R/machine.txt 2>&1
for i in 1 2 3; do
  for v in pipelined2 params; do
    KV_GATHER_UPLOAD=$v timeout 60 bash .bundle/run.sh bench transfer --profile gpu --repeats 10 --json $R/t-$v-$i.json > $R/t-$v-$i.log 2>&1
    echo "t-$v-$i rc=$?" >> $R/rc.txt
  done
done
T=data/traces/mooncake_conversation_trace.jsonl
for v in new main; do
  timeout 150 lookup-bins/lookup-bench-$v --only concurrent --threads 1+1,8+8,12+4 --seconds 2 --trace $T \
    --json $R/lookup-$v.json > $R/lookup-$v.log 2>&1
  echo "lookup $v rc=$?" >> $R/rc.txt
done
for h in 1 0; do
  GLIBC_TUNABLES=glibc.malloc.hugetlb=$h timeout 60 lookup-bins/lookup-bench-new --only single --trace $T \
    --json $R/single-thp$h.json > $R/single-thp$h.log 2>&1
  echo "single hugetlb=$h rc=$?" >> $R/rc.txt
done
cd $OUT && tar czf c.tar.gz c && rm -rf c
