#!/bin/bash
# usage: cpu_per_event.sh ROUNDS BIN...   (T0+E1, synthetic per-event thread: CPU us per event)
R=$1; shift
for r in $(seq 1 $R); do
  for b in "$@"; do
    out=$(perf record -q -F 999 -e cpu-clock -o /tmp/cpe.data $b --only concurrent --threads 0+1 --seconds 2 --trace-requests 1 2>&1 | grep -E "^synthetic.*T0\+E1: ours" | grep -v batched | head -1)
    ev=$(echo "$out" | grep -o "[0-9]* events/s" | head -1 | cut -d' ' -f1)
    # second distinct tid in time order = synthetic per-event event thread
    tid=$(perf script -i /tmp/cpe.data -F tid 2>/dev/null | awk '{print $1}' | awk '!s[$1]++' | sed -n 2p)
    n=$(perf script -i /tmp/cpe.data -F tid 2>/dev/null | awk -v t=$tid '$1==t' | wc -l)
    echo "round $r $(basename $b): $ev events/s wall; event thread $n ms CPU; $(python3 -c "print(f'{$n*1000/($ev*2):.2f}')") us CPU/event; load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
