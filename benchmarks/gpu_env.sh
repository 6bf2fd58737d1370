# Source on the device machine (its image has torch/triton but no diffusers and no h3lab install):
# installs the carried wheels (.whl/) into /tmp/site and makes `h3lab` and `h3kernels` importable from the tree.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
ln -sfn "$PWD/kernels" /tmp/site/h3kernels
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
if [ -f .git_rev ]; then export H3LAB_GIT_REV="$(cat .git_rev)"; fi  # the device copy's own .git may be stale
