#!/usr/bin/env bash
# Set up flashsgd in ./.venv: one command, fresh machine, no multi-GB CUDA download on CPU machines.
#
# - The venv sees the system's site-packages, so a GPU user's own CUDA torch is used as it is.
# - Only when no torch is importable does it install torch==2.13.0 (the CPU wheel on CPU machines;
#   set FLASHSGD_TORCH to choose another spec, e.g. FLASHSGD_TORCH="torch==2.13.0+cu126").
# - Then flashsgd itself, editable, with the test extras.
# - As root, iproute2 (ip, tc) for the emulated cluster benchmarks, when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install "${FLASHSGD_TORCH:-torch==2.13.0}"
fi
"${PIP[@]}" install -e ".[dev]" 2> >(grep -v "is ignored: it is neither" >&2)
if [ -x scripts/install_iproute2.sh ] || [ -f scripts/install_iproute2.sh ]; then
    bash scripts/install_iproute2.sh || echo "note: iproute2 not installed; emulated-cluster tests will be skipped" >&2
fi
.venv/bin/python -c "import torch, flashsgd; print(f'flashsgd {flashsgd.__version__} ready: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}')"
