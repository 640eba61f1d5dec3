"""A pipeline exchange with one end late: what each end pays, beside both ends arriving together.

    python -m benchmarks.pipeline_exchange [--bytes 32768,262144] [--late 0,2,5] [--iterations 40]

Megatron-Core's 1F1B schedule batches a stage's send and receive into one call (``batch_isend_irecv``,
then wait for both), and the neighbour makes the matching call: its activation for our gradient, or the
reverse. In a real step the two ends seldom arrive together: one waits, blocked, for the other.
``autotuner.predict.schedule`` charges each exchange to both ends, one calibrated ``send_recv`` each
(``python -m autotuner.calibrate collectives=true``, which times the exchange with both ranks at it).
This times two processes (gloo; it starts them with torchrun itself) making that exchange, one of
them arriving ``--late`` ms after the other (spinning until then, as a stage computes), alternately
rank 0 and rank 1, after a barrier; and prints, per size and lateness, the medians of how long the late
end's call took and how long after the late end's arrival the early end's call returned (one machine:
``time.perf_counter`` is one clock for both processes).

What it showed on a 2-core CPU VM (three runs): with both ends arriving together the
late end's call took 0.21-0.32 ms (32 KiB, tiny's activations) and 0.28-0.40 ms (256 KiB); with one end
2 or 5 ms late, 0.23-0.49 and 0.27-0.55 ms, the early end back 0.21-0.36 and 0.25-0.51 ms after the late
one arrived. So an exchange costs both ends about its calibrated time whether or not one waited (a
little more, noisily), and the hand-overs measured inside the real steps (0.44-0.87 ms, the sender's
last op to the receiver's first) hold the schedule's own work around the exchange besides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _measure(sizes: list[int], lateness_ms: list[float], iterations: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    try:
        for nbytes in sizes:
            sent, received = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
            for late_ms in lateness_ms:
                late_calls, early_after = [], []
                for i in range(iterations + 4):  # the first 4 warm the pair up
                    late = i % 2
                    dist.barrier()
                    if rank == late:
                        until = time.perf_counter() + late_ms / 1e3
                        while time.perf_counter() < until:
                            pass
                    arrived = time.perf_counter()
                    ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, received, peer)]
                    for request in dist.batch_isend_irecv(ops):
                        request.wait()
                    left = time.perf_counter()
                    both = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
                    dist.all_gather(both, torch.tensor([arrived, left], dtype=torch.float64))
                    if i >= 4:
                        (late_in, late_out), (_, early_out) = both[late].tolist(), both[1 - late].tolist()
                        late_calls.append(late_out - late_in)
                        early_after.append(early_out - late_in)
                if rank == 0:
                    print(
                        f"{nbytes:>9} B  {late_ms:5.1f} ms late: the late end's call "
                        f"{statistics.median(late_calls) * 1e3:6.3f} ms, the early end back "
                        f"{statistics.median(early_after) * 1e3:6.3f} ms after the late one arrived"
                    )
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", default="32768,262144", help="exchanged bytes, comma-separated")
    parser.add_argument("--late", default="0,2,5", help="how late one end arrives, ms, comma-separated")
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args()
    sizes = [int(b) for b in args.bytes.split(",")]
    lateness = [float(x) for x in args.late.split(",")]
    if "WORLD_SIZE" in os.environ:
        _measure(sizes, lateness, args.iterations)
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "benchmarks.pipeline_exchange", "--bytes", args.bytes, "--late", args.late]
    command += ["--iterations", str(args.iterations)]
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
