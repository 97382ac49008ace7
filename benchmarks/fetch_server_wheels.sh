#!/usr/bin/env bash
# Fetch the wheels `jlight serve` and structured outputs need on the GPU machine (Python 3.12, x86-64, no network there;
# its image lacks fastapi, starlette, pydantic, uvicorn ...) into .whl/ of this checkout, which
# .git/info/exclude must ignore. Carry `.whl` in the device call; `bash benchmarks/gpu.sh serving`
# installs them with benchmarks/install_carried_wheels.py. These are the versions of the H200 run of
# 2026-11-29 (docs/BENCHMARKS.md, Serving); fallback/ holds newer copies of packages the image
# already has, installed only if the image's are too old.
#   bash benchmarks/fetch_server_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
fetch() {  # DIR NAME==VERSION ...
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@"
}
fetch .whl fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 uvicorn==0.54.0 \
  typing-inspection==0.4.2 annotated-types==0.7.0 opentelemetry-api==1.45.2
fetch .whl --platform manylinux_2_31_x86_64 llguidance==1.9.1  # structured outputs (`gpu.sh structured`); the sixteenth session's carried version
fetch .whl/fallback typing-extensions==4.16.0 annotated-doc==0.0.7 anyio==4.16.0
ls .whl .whl/fallback
