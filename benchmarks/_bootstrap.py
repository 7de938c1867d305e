"""Makes `benchmarks.*` importable when a benchmark script runs as a file.

``python benchmarks/<name>.py`` puts ``benchmarks/`` on ``sys.path``, not the repository root, so the script's
``import benchmarks...`` would fail where ``python -m benchmarks.<name>`` works. Each script imports this module
(found next to it) only when it runs as a file, and it puts the repository root first, as ``-m`` from the root does.
"""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
