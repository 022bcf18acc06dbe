#!/usr/bin/env bash
# Make the torch of the Python the user runs importable in a flashsgd venv (setup.sh Step 1).
#
# Usage: use_user_torch.sh PYTHON VENV
#
# A venv made with --system-site-packages sees the base interpreter's site-packages only: a torch
# installed in the virtual environment the user activated (a CUDA build matching their driver) is
# not seen, and setup.sh would download another one. When PYTHON imports a torch that VENV does not
# import (or imports from elsewhere), PYTHON's site-packages directory is added to VENV's path by a
# .pth file (after VENV's own packages, before the base interpreter's). Nothing happens when PYTHON
# has no torch, or VENV already uses that one.
set -euo pipefail
PYTHON="$1"
VENV="$2"
where_torch='import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))'
user_site="$("$PYTHON" -c "$where_torch" 2>/dev/null || true)"
if [ -n "$user_site" ] && [ "$("$VENV/bin/python" -c "$where_torch" 2>/dev/null || true)" != "$user_site" ]; then
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$user_site" > "$site/flashsgd-user-torch.pth"
    echo "setup: using the torch of $PYTHON ($user_site)" >&2
fi
