#!/bin/sh
# Fetch the wheels `herald bench device` needs on a GPU machine that reaches no package
# registry (docs/bench.md, "One device run"), and the data its CUDA exactness tests read.
# Run here, where pip reaches a registry; carry the folder to the machine and pass it as
#   python3 -m herald bench device --wheels DIR --out OUT
# which installs them with `pip install --no-index --no-deps --find-links DIR --target DIR/site`
# before its sections run (each section a child process with DIR/site on its PYTHONPATH).
#
# The machine's image holds torch (CUDA), numpy, numba, pyarrow, msgpack, psutil,
# matplotlib, tqdm, pytest, pytest-timeout, hypothesis and pyre-extensions; this adds
# pyzmq, kafka-python, TorchRec and FBGEMM's CPU build for that torch (FBGEMM's CUDA build
# is hundreds of MB: the TorchRec GPU figure then says "fbgemm-gpu CUDA build not
# installed"), and tensordict, iopath, pyvers, the TorchRec imports.
#
#   scripts/device_wheels.sh [DIR]     DIR: default .cache/device-wheels (git-ignored)
#   TORCH=2.11 PYTHON_VERSION=3.12 scripts/device_wheels.sh   (the machine's torch and Python)
#
# FBGEMM X.Y is built for torch 2.(Y+5) (fbgemm-gpu-cpu 1.8.0 for torch 2.13, pinned in
# the Makefile); torchrec takes the same minor release.
set -eu
cd "$(dirname "$0")/.."
DIR=${1:-.cache/device-wheels}
TORCH=${TORCH:-2.11}
PYV=${PYTHON_VERSION:-3.12}
PY=${PYTHON:-python3}
minor=$(( ${TORCH#2.} - 5 ))
case "$minor" in
  6) FBGEMM=1.6.0 TORCHREC=1.6.1 ;;
  7) FBGEMM=1.7.0 TORCHREC=1.7.0 ;;
  8) FBGEMM=1.8.0 TORCHREC=1.8.0 ;;
  *) echo "device_wheels.sh: no FBGEMM known for torch $TORCH; set TORCH=2.11, 2.12 or 2.13" >&2; exit 2 ;;
esac
mkdir -p "$DIR"
tag=$(echo "$PYV" | tr -d .)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --abi "cp$tag" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DIR" "fbgemm-gpu-cpu==$FBGEMM" "torchrec==$TORCHREC" pyzmq==27.1.0 kafka-python==2.0.2 \
  tensordict==0.15.3 iopath==0.1.9 pyvers==0.2.3
# the Criteo sample the CUDA exactness tests train on (HERALD_DATA): the device copy of the
# tree holds no ../shared
mkdir -p "$DIR/data/criteo"
cp ../shared/data/criteo/criteo_kaggle_sample_train.tsv "$DIR/data/criteo/"
du -sh "$DIR"
ls "$DIR"
