# Source this on the lent H200 machine (benchmarks/RESULTS.md): installs the wheels carried in .whl (pydantic and
# what it needs; the machine has no registry), makes this checkout importable as `kvgen` without installing it, and
# prints the machine's versions. Usage: `source benchmarks/device_env.sh` from the repository root, after filling .whl
# here: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#   --platform manylinux_2_17_x86_64 -d .whl pydantic==2.13.4 pydantic_core==2.46.4 annotated-types \
#   typing-inspection typing_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || return 1
mkdir -p /tmp/kvroot && ln -sfn "$PWD" /tmp/kvroot/kvgen
export PYTHONPATH=/tmp/site:/tmp/kvroot PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version.split()[0])"
date -u
