#!/usr/bin/env bash
# Fill the git-ignored folder the device run carries: .whl (pure-Python wheels the device image lacks).
# The oracle travels with the tree (tests/oracle).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0
# The server's GPU test (tests/model/test_server.py) drives it with the openai client: the serve extra and
# the client with their dependencies (pydantic-core is the one binary wheel: the device's CPython 3.12, x86-64).
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --implementation cp -d .whl starlette uvicorn openai
# response_format's grammar matcher (abi3, one binary wheel for any CPython >= 3.9 on x86-64 glibc >= 2.31).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 \
  --implementation cp -d .whl llguidance==1.9.1
du -sh .whl
