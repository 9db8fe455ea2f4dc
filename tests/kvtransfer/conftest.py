"""Make the repository root importable (kvtransfer) and this folder (kvt_harness) for tests and
for the worker processes they spawn (spawn children inherit sys.path)."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for p in (str(_HERE.parents[1]), str(_HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)
