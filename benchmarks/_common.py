"""Shared set-up of the benchmark scripts (imported before numpy)."""

from __future__ import annotations

import os
import sys


def pin_blas_threads(default: str = "1") -> str:
    """Set the BLAS thread count from ``--blas-threads N`` (default 1) and return it.

    Must run before numpy is imported: OpenBLAS reads its thread count once, at load. One thread is the default
    because minienv's matrices are tiny — a second thread costs more in hand-off than it saves, and on a shared
    machine spinning BLAS threads made small matmuls many times slower.
    """
    threads, argv = default, sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg.startswith("--blas-threads="):
            threads = arg.split("=", 1)[1]
        elif arg == "--blas-threads" and i + 1 < len(argv):
            threads = argv[i + 1]
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = threads
    return threads
