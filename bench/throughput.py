"""The throughput and latency benchmark (the `pocketllm.bench` package), writing into bench/results/.

    python bench/throughput.py            # small preset, about 10 minutes on 2 CPU cores
    python bench/throughput.py --quick    # tiny preset, under a minute
"""

from __future__ import annotations

import sys
from pathlib import Path

from pocketllm.bench import main

if __name__ == "__main__":
    # A later --out on the command line overrides this default.
    sys.exit(main(["--out", str(Path(__file__).parent / "results"), *sys.argv[1:]]))
