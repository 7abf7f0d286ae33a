# Sourced by dev/study and dev/test: make .venv with memstudy and its dependencies if missing.
# `pip install torch` from the registry gives a CUDA build that also runs on the CPU; its
# torchvision (needed by segmentation-models-pytorch) is resolved to the matching version.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEMSTUDY_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
if ! "$PY" -c "import memstudy, torchvision, segmentation_models_pytorch, nbclient" 2>/dev/null; then
    echo "dev/env.sh: creating $VENV (first run: downloads torch, a few GB)" >&2
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -e "$ROOT[test]"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
