#!/usr/bin/env bash
# Set up a fresh machine (Python 3.11): a .venv with the CPU torch wheel and the locked stack.
# litdata declares torchvision, whose PyPI build does not import beside torch 2.13.0 and then
# breaks `import lightning`; nothing here uses it, so the lock is installed with --no-deps.
# On a CUDA machine install your torch build first (and `pip install flash-attn`), then run this.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  grep -v '^torch==' requirements.lock > .venv/requirements.gpu.lock
  .venv/bin/python -m pip install -q --no-deps -r .venv/requirements.gpu.lock
else
  .venv/bin/python -m pip install -q --no-deps -r requirements.lock
fi
.venv/bin/python -m pip install -q --no-deps -e .
# Triton for the fused kernels' tests under its interpreter (TRITON_INTERPRET=1) where torch has no CUDA (a CUDA
# torch brings its own): outside site-packages, which lightning would otherwise import it from in every process
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null &&
  [ ! -d .venv/triton-interpreter/triton ]; then
  .venv/bin/python -m pip install -q --no-deps --target .venv/triton-interpreter triton==3.9.0
fi
# pip compiles the locked packages; the editable package's bytecode is written here once, so that each
# process (a sweep's workers, the tests' commands) does not compile it again where PYTHONDONTWRITEBYTECODE is set
.venv/bin/python -m compileall -q -j 0 recursive_lightning >/dev/null
# lm-eval 0.4 does not read entry points: a start-up hook registers ours so `lm_eval --model recursive_lightning` works
.venv/bin/python -m recursive_lightning.evaluation.harness_hook install
.venv/bin/python -c "import torch, lightning, litdata, mlflow, optuna, lm_eval, psycopg; print('recursive_lightning environment ready: torch', torch.__version__)"
