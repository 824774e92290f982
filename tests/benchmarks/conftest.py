"""Makes the benchmark scripts importable by name (``import multigpu``), as they import each
other when run as ``python benchmarks/<name>.py``. Appended, not prepended: they must not
shadow any module the other tests import."""

import os
import sys

sys.path.append(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
