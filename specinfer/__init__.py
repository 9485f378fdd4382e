"""specinfer: tree-based speculative inference and verification for LLM serving."""

import os

__version__ = "0.1.0"

# Memory: oneDNN's primitive cache and torch's ideep cache each keep an entry per shape a
# packed linear runs at (here: per number of token rows in a step), 1,024 each by default.
# Every new row count cost ~0.6 MiB per weight shape, so a long-running verifier's C heap
# grows as its steps meet new row counts: +456 MiB for three weight shapes at 700 row
# counts with the defaults, +115 MiB at 256 (a miss costs ~0.4 ms to rebuild). Bounded
# lower here; a value set by the user wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
os.environ.setdefault("LRU_CACHE_CAPACITY", "256")
