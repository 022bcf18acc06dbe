"""Which build of torch a pip resolution would install: ``cuda`` or ``cpu`` (used by setup.sh).

Reads ``pip install --dry-run --report -`` JSON on stdin (pip resolves from the wheels' metadata,
without downloading them) and prints ``cuda`` when the resolution installs NVIDIA's CUDA wheels
(``nvidia-*``: PyPI's default torch on Linux, several GB) or a ``+cu`` local version, else ``cpu``;
``unknown`` when the report cannot be read (setup.sh then installs nothing it was not asked to).

Example::

    pip install --dry-run --report - -q torch==2.13.0 | python scripts/torch_build.py    # cuda
"""

from __future__ import annotations

import json
import sys


def build(report: dict) -> str:
    """``cuda`` or ``cpu`` for one pip installation report (its ``install`` list)."""
    items = [i.get("metadata", {}) for i in report.get("install", [])]
    names = [str(m.get("name", "")).lower() for m in items]
    torch_versions = [str(m.get("version", "")) for m in items if str(m.get("name", "")).lower() == "torch"]
    if any(n.startswith("nvidia-") for n in names) or any("+cu" in v for v in torch_versions):
        return "cuda"
    return "cpu"


def main() -> int:
    try:
        print(build(json.loads(sys.stdin.read())))
    except (ValueError, AttributeError, TypeError):
        print("unknown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
