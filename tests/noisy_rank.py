"""Run ``python -m autotuner.main`` with one rank made slower and noisier than the others.

Usage (under torchrun): ``torchrun ... tests/noisy_rank.py ARGS...`` runs ``autotuner.main ARGS`` on
every rank; on the rank named by ``NOISY_RANK`` (default 1) a background thread spins in Python. It takes
the interpreter lock for a switch interval at a time, so that rank's op calls (Python-heavy at the tiny
case's sizes) take longer and spread wider, as a rank sharing its core with a data loader would. Its
sampler alone would then stop on a different rule, or after a different number of samples, than rank 0's.
The switch interval is 1 ms there, not Python's 5 ms: still tens of times the tiny ops' own time, while
the run ends in half the time (a noisy rank's every return to Python waits up to one interval).
"""

from __future__ import annotations

import os
import sys
import threading

from autotuner.main import main


def _spin() -> None:
    count = 0
    while True:
        count += 1


if os.environ.get("LOCAL_RANK") == os.environ.get("NOISY_RANK", "1"):
    sys.setswitchinterval(0.001)
    threading.Thread(target=_spin, daemon=True).start()

if __name__ == "__main__":
    main()
