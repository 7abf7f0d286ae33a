# Sourced by dev/study and dev/test: make .venv with memstudy and its dependencies if missing.
# `pip install torch` from the registry gives a CUDA build that also runs on the CPU; its
# torchvision (needed by segmentation-models-pytorch) is resolved to the matching version.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEMSTUDY_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
if ! "$PY" -c "import memstudy, torchvision, segmentation_models_pytorch, nbclient, plotly, submitit, xdist, pytest_timeout" 2>/dev/null; then
    echo "dev/env.sh: creating $VENV (first run: downloads torch, a few GB)" >&2
    # torch's CUDA build and its libraries take about 6 GB installed: say so up front, since
    # pip reports a full disk only at the end, as "[Errno 28] No space left on device"
    free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR == 2 {print $4}')
    if [ -n "$free_kb" ] && [ "$free_kb" -lt $((7 * 1024 * 1024)) ]; then
        echo "dev/env.sh: warning: $((free_kb / 1024)) MB free under $(dirname "$VENV"); the" \
             "environment needs about 6 GB (set MEMSTUDY_VENV to a folder on a larger disk)" >&2
    fi
    python3 -m venv "$VENV"
    # --no-cache-dir: from a remote index pip would also keep every wheel it downloaded
    # (about 3 GB for torch and its CUDA libraries) in its cache beside the installed copy
    "$PY" -m pip install -q --no-cache-dir --upgrade pip
    "$PY" -m pip install -q --no-cache-dir -e "$ROOT[test]"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
