#!/bin/bash
# usage: thp.sh ROUNDS BIN : T0+E1 CPU us/event and single-threaded synthetic lookup p50/p99, GLIBC_TUNABLES=glibc.malloc.hugetlb=0 vs 1
R=$1; B=$2
for r in $(seq 1 $R); do
  for v in 0 1; do
    out=$(GLIBC_TUNABLES=glibc.malloc.hugetlb=$v perf record -q -F 999 -e cpu-clock -o /tmp/thp.data $B --only concurrent --threads 0+1 --seconds 2 --trace-requests 1 2>&1 | grep -E "^synthetic.*T0\+E1: ours per" | head -1)
    ev=$(echo "$out" | grep -o "[0-9]* events/s" | head -1 | cut -d' ' -f1)
    tid=$(perf script -i /tmp/thp.data -F tid 2>/dev/null | awk '{print $1}' | awk '!s[$1]++' | sed -n 2p)
    n=$(perf script -i /tmp/thp.data -F tid 2>/dev/null | awk -v t=$tid '$1==t' | wc -l)
    single=$(GLIBC_TUNABLES=glibc.malloc.hugetlb=$v $B --only single --trace-requests 1 2>&1 | grep -E "^synthetic.*lookup p(50|99) +RadixTree" | awk '{print $4":"$6"/"$7}' | tr '\n' ' ')
    echo "round $r hugetlb=$v: T0+E1 $ev events/s, $(python3 -c "print(f'{$n*1000/($ev*2):.2f}')") us CPU/event; single synthetic lookup p50 p99 ours/RadixTree: $single; load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
