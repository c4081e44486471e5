#!/usr/bin/env bash
# Fill the git-ignored folders the device run carries: .whl (pure-Python wheels the device image lacks)
# and .oracle (a copy of ../shared/oracle, which the device does not see).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0
rm -rf .oracle && cp -r ../shared/oracle .oracle
du -sh .whl .oracle
