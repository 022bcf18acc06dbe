"""Check a pip resolution before installing it: refuse one that would install another torch.

Reads ``pip install --dry-run --report -`` JSON on stdin (pip resolves from the wheels' metadata,
without downloading them). Prints the planned packages as ``name==version``, one a line (for
``pip install --no-deps``: exactly what was checked is installed), and exits 0; or, when the plan
contains torch, a package of its family built against one torch (torchvision, torchaudio, triton)
or an NVIDIA CUDA wheel (``nvidia-*``: several GB), prints nothing, names them on stderr and exits
1: an optional extra such as ``flashsgd[integrations]`` must use the torch already installed (a
GPU user's own CUDA build, or the CPU wheel setup.sh chose), never replace it. Exit 2: the report
cannot be read. ``--skip NAME`` leaves a planned package out of the printed pins (``flashsgd``
itself, installed editable).

Example::

    pip install --dry-run --report - -q "lightning>=2.4" "accelerate>=1.0" | python scripts/pip_plan.py
"""

from __future__ import annotations

import argparse
import json
import sys

REFUSED = ("torch", "torchvision", "torchaudio", "triton")
"""Packages that are (or are built against) one torch; with ``nvidia-*``, never in an extra's plan."""


def refused(report: dict) -> list[str]:
    """The planned packages that would replace torch or bring CUDA wheels, as ``name==version``."""
    return [pin for pin, name in _planned(report) if name in REFUSED or name.startswith("nvidia-")]


def _planned(report: dict) -> list[tuple[str, str]]:
    out = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name = str(meta.get("name", "")).lower().replace("_", "-")
        out.append((f"{meta.get('name')}=={meta.get('version')}", name))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", action="append", default=[], metavar="NAME",
                        help="a planned package to leave out of the printed pins (e.g. flashsgd)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(sys.stdin.read())
        planned = _planned(report)
    except (ValueError, AttributeError, TypeError) as exc:
        print(f"pip_plan: not a pip installation report ({exc})", file=sys.stderr)
        return 2
    bad = refused(report)
    if bad:
        print(f"pip_plan: refused: the plan would install {', '.join(bad)} (another torch or CUDA wheels)",
              file=sys.stderr)
        return 1
    skip = {s.lower().replace("_", "-") for s in args.skip}
    for pin, name in planned:
        if name not in skip:
            print(pin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
