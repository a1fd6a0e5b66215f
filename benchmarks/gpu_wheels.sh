#!/usr/bin/env bash
# Download, into .whl/, the Python 3.12 wheels a lent GPU machine lacks for benchmarks/gpu_session.sh: its image
# has torch, lightning, torchmetrics, numpy, pandas, pyarrow and transformers, but not MLflow, litdata, Optuna and
# their needs (and liger-kernel and torchao for the kernels and float8 steps). Versions come from requirements.lock;
# about 57 MB (the device tool carries 64 MiB with the tree).
#   bash benchmarks/gpu_wheels.sh       then: run "bash benchmarks/gpu_session.sh" with carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
NEEDED="alembic annotated-types blinker boto3 botocore cachetools cffi colorlog cryptography databricks-sdk datasets
defusedxml dill fastapi Flask gitdb GitPython google-auth httpcore2 httpx2 importlib_metadata itsdangerous jmespath
litdata Mako mlflow mlflow-skinny mlflow-tracing more-itertools multiprocess opentelemetry-api opentelemetry-proto
opentelemetry-sdk opentelemetry-semantic-conventions optuna pyasn1 pyasn1_modules pycparser pydantic pydantic_core
python-dotenv pytz s3transfer smmap SQLAlchemy sqlparse starlette truststore typing-inspection tzdata uvicorn wcwidth"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo /.whl/ >>.git/info/exclude; }
mkdir -p .whl
pins=()
for name in $NEEDED; do
  pin=$(grep -i "^${name}==" requirements.lock) || { echo "requirements.lock has no $name"; exit 2; }
  pins+=("$pin")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "${pins[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# liger-kernel (pure Python; Triton comes with the machine's torch) for the `kernels` step: not a dependency of the
# package, so not in requirements.lock
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl liger-kernel==0.8.5 \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# torchao (float8 training, its Python path; built for torch >= 2.11) for the `float8` step, likewise not a dependency
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0 \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
du -sh .whl
