"""Client-observed advise latency through the router binary over NATS, by prompt size and pacing.

Run from the repository root with a Python that has the kv_reuse wheel and numpy, nats-server on PATH
and the router binary as $KVQ_ROUTER_BIN (README.md next to this file). LOOP=S: S seconds of
back-to-back 2,048-block advises instead of the table, printing how many completed.
CLIENT_BUSY_POLL_US=N: the RouterClient polls N us for each reply before sleeping (default 0);
arguments are passed to the router (e.g. --advise-busy-poll-us N)."""
import json, os, subprocess, sys, time, statistics
TESTS = os.path.join(os.getcwd(), "crates", "kv-reuse-py", "tests")
sys.path.insert(0, TESTS)
import kv_reuse
from nats_fake import NatsServer, find_nats_server, find_router_binary

TPB = 16
def pct(xs, q):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(q * len(xs)))]

def main():
    blocks_max = int(os.environ.get("BLOCKS", "2048"))
    server = NatsServer(find_nats_server(), "/tmp/advlat-js")
    router = subprocess.Popen([find_router_binary(), "--nats-url", server.url, "--metrics-addr", "127.0.0.1:0",
                               "--tokens-per-block", str(TPB), "--announce-period-ms", "200",
                               "--enable-decode-to-prefill-reuse"] + sys.argv[1:],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    print(router.stdout.readline().strip())
    donor = subprocess.Popen([sys.executable, os.path.join(TESTS, "publisher_proc.py"), server.url,
                              "/tmp/advlat-pins.sock", str(TPB), str(blocks_max), "1"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hello = json.loads(donor.stdout.readline())
    layout = kv_reuse.Layout(2, 2, 8, "f32", TPB, 1)
    target = kv_reuse.Target(layout, rows=16)
    other = "00000000-0000-4000-8000-00000000abcd"
    try:
        busy = int(os.environ.get("CLIENT_BUSY_POLL_US", "0"))
        print(f"client busy poll {busy} us; router args {sys.argv[1:]}", flush=True)
        with kv_reuse.RouterClient(server.url, timeout_s=5.0, busy_poll_us=busy) as c, \
             kv_reuse.WorkerPublisher.target(server.url, "p", layout, target.engine_id, announce_period_s=0.2), \
             kv_reuse.WorkerPublisher.target(server.url, "q", kv_reuse.Layout(2, 2, 8, "f32", TPB, 1), other, announce_period_s=0.2):
            tokens = list(range(TPB * blocks_max))
            if os.environ.get("LOOP"):
                hashes = kv_reuse.sequence_hashes(tokens, TPB)
                deadline = time.time() + 20
                while not c.advise("w", hashes, target.engine_id).admitted:
                    assert time.time() < deadline; time.sleep(0.1)
                print("PIDS", os.getpid(), router.pid, server.proc.pid, flush=True)
                n, t_end = 0, time.time() + float(os.environ["LOOP"])
                while time.time() < t_end:
                    c.advise(f"l{n}", hashes, target.engine_id); n += 1
                print("loop advises", n, flush=True)
                return
            for blocks in (128, 512, 2048):
                if blocks > blocks_max: continue
                hashes = kv_reuse.sequence_hashes(tokens[:TPB * blocks], TPB)
                t0 = time.perf_counter(); kv_reuse.sequence_hashes(tokens[:TPB * blocks], TPB); th = (time.perf_counter() - t0) * 1e6
                deadline = time.time() + 20
                while not c.advise("w", hashes, target.engine_id).admitted:
                    assert time.time() < deadline; time.sleep(0.1)
                # "other": the second announced prefill target (same layout, so admitted too;
                # logs before session 19 call it "nodonor").
                for label, tgt in (("admitted", target.engine_id), ("other", other)):
                    for gap in (0.0, 0.02):
                        lat = []
                        for i in range(200 if gap == 0 else 60):
                            if gap: time.sleep(gap)
                            t0 = time.perf_counter()
                            a = c.advise(f"r{i}", hashes, tgt)
                            lat.append((time.perf_counter() - t0) * 1e6)
                        print(f"blocks {blocks:5d} {label:9s} gap {gap*1e3:4.0f} ms: p50 {statistics.median(lat):7.1f} us  p90 {pct(lat,.9):7.1f}  min {min(lat):7.1f}  (hash {th:.0f} us; admitted {a.admitted}, hint {len(a.hint or b'')} B)")
    finally:
        donor.stdin.close(); donor.wait(10)
        router.terminate(); router.wait(10)
        server.stop()

main()
