#!/usr/bin/env bash
# Set up flashsgd in ./.venv: one command, fresh machine, no multi-GB CUDA download on CPU machines.
#
# 1. The torch of the Python the user runs is used as it is: the venv sees the system's
#    site-packages, and a torch in the virtual environment the user activated (which a venv made
#    from it does not see: only the base interpreter's) joins .venv's path through a .pth file.
# 2. Only when no torch is importable is torch installed:
#    - FLASHSGD_TORCH set: that spec, as given (e.g. FLASHSGD_TORCH="torch==2.13.0+cu126");
#    - an NVIDIA driver present (nvidia-smi): torch from the package registry (a CUDA build);
#    - otherwise: PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu, ~200 MB instead
#      of several GB of nvidia-* wheels). When that fails, its reason is shown, and the registry's
#      torch is installed only if it is a CPU build (a mirror that pins a CPU wheel, as ours do;
#      pip resolves it without downloading: scripts/torch_build.py); a CUDA build is not downloaded
#      onto a machine without a GPU unless asked (FLASHSGD_TORCH, or FLASHSGD_ALLOW_CUDA_TORCH=1).
# 3. flashsgd itself, editable, with the test extras - skipped when this checkout is already
#    installed in .venv with the same pyproject.toml (so a second run works offline: compute nodes
#    often are); FLASHSGD_REINSTALL=1 forces it. With it the `integrations` extra (Lightning,
#    Accelerate), only if pip's plan for it installs no torch (Step 3b).
# 4. As root, iproute2 (ip, tc) for the emulated cluster benchmarks, when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${FLASHSGD_TORCH:-torch==2.13.0}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# Step 1: the user's own torch (an activated venv's too), unless .venv already imports that one
bash scripts/use_user_torch.sh "$PYTHON" .venv

# Step 2
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if [ -n "${FLASHSGD_TORCH:-}" ] || command -v nvidia-smi >/dev/null 2>&1; then
        echo "setup: installing $TORCH_SPEC from the package registry" >&2
        "${PIP[@]}" install "$TORCH_SPEC"
    else
        echo "setup: no NVIDIA driver: installing the CPU build of $TORCH_SPEC from $CPU_INDEX" >&2
        if ! err="$("${PIP[@]}" install --timeout 15 --retries 1 --index-url "$CPU_INDEX" "$TORCH_SPEC" 2>&1)"; then
            echo "setup: the CPU build could not be installed from $CPU_INDEX:" >&2
            echo "$err" | grep -v '^\s*$' | tail -n 4 | sed 's/^/setup:   /' >&2
            build="$({ "${PIP[@]}" install --dry-run --report - "$TORCH_SPEC" 2>/dev/null || true; } \
                     | .venv/bin/python scripts/torch_build.py)"
            if [ "$build" = cpu ] || [ "${FLASHSGD_ALLOW_CUDA_TORCH:-0}" = 1 ]; then
                echo "setup: installing $TORCH_SPEC from the package registry (a $build build)" >&2
                "${PIP[@]}" install "$TORCH_SPEC"
            else
                echo "setup: the package registry's $TORCH_SPEC is a $build build (CUDA: several GB of" \
                     "nvidia-* wheels) and this machine has no NVIDIA driver, so it was not installed;" \
                     "fix the CPU index's problem above, or install it anyway with" \
                     "FLASHSGD_ALLOW_CUDA_TORCH=1 (or FLASHSGD_TORCH=SPEC)" >&2
                exit 1
            fi
        fi
    fi
fi

# Step 3b: the trainer integrations' packages (the `integrations` extra: Lightning, Accelerate) for
# their tests, never another torch: pip's plan is read first (a dry run: metadata only) and refused
# by scripts/pip_plan.py if it holds torch, its family or nvidia-* wheels; then exactly the checked
# pins are installed (--no-deps). Not installable (offline, refused): a note, and their tests skip.
# FLASHSGD_INTEGRATIONS=0 leaves them out.
install_integrations() {
    [ "${FLASHSGD_INTEGRATIONS:-1}" = 0 ] && return 0
    local plan pins
    if ! plan="$("${PIP[@]}" install --dry-run --report - -e ".[dev,integrations]" 2>/dev/null)"; then
        echo "setup: note: the integrations extra (Lightning, Accelerate) could not be resolved (offline?);" \
             "their tests will be skipped" >&2
        return 0
    fi
    if ! pins="$(echo "$plan" | .venv/bin/python scripts/pip_plan.py --skip flashsgd)"; then
        echo "setup: note: the integrations extra was not installed (it would replace torch; above);" \
             "their tests will be skipped. Install lightning and accelerate for this torch by hand." >&2
        return 0
    fi
    if [ -n "$pins" ]; then
        echo "setup: installing the integrations extra: $(echo "$pins" | tr '\n' ' ')" >&2
        # shellcheck disable=SC2086
        "${PIP[@]}" install --no-deps $pins 2> >(grep -v "is ignored: it is neither" >&2)
    fi
}

# Step 3
stamp=.venv/.flashsgd-installed
want="$(pwd) $(.venv/bin/python -c 'import hashlib,sys; print(hashlib.sha256(open("pyproject.toml","rb").read()).hexdigest())')"
if [ "${FLASHSGD_REINSTALL:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && .venv/bin/python -c "import flashsgd, pytest, tqdm, tomli_w" 2>/dev/null; then
    echo "setup: flashsgd already installed in .venv from this checkout (FLASHSGD_REINSTALL=1 to redo)" >&2
else
    "${PIP[@]}" install -e ".[dev]" 2> >(grep -v "is ignored: it is neither" >&2)
    install_integrations
    echo "$want" > "$stamp"
fi

# Step 4
if [ -f scripts/install_iproute2.sh ]; then
    bash scripts/install_iproute2.sh || echo "note: iproute2 not installed; emulated-cluster tests will be skipped" >&2
fi
.venv/bin/python -c "import torch, flashsgd; print(f'flashsgd {flashsgd.__version__} ready: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}')"
