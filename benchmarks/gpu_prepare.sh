#!/usr/bin/env bash
# Run HERE (the development machine) before a device run: fetches the wheels the GPU image lacks into .whl/
# (diffusers 0.42.1 and its missing dependency importlib_metadata, transformers 5.24 as tested here, peft 0.21.2 (pure Python) for LoRA; python 3.12 / manylinux tags of that image) and
# records the commit in .git_rev (the device copy has no .git). Both paths are git-ignored through
# .git/info/exclude and travel with the run's `carry: [".whl", ".git_rev"]`; benchmarks/gpu_env.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
for p in /.whl/ /.git_rev; do grep -qxF "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl diffusers==0.42.1 importlib_metadata transformers==5.24.0 peft==0.21.2
git rev-parse HEAD > .git_rev
ls .whl && echo "git_rev $(cat .git_rev)"
