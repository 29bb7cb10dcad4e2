#!/usr/bin/env bash
# The main job on the embedded default, no network needed:
#   1. build the tiny random-weight Qwen3 + ChatML tokenizer (build/tiny-qwen3),
#   2. tokenise and register the shipped sample chats (data/sample_chat.jsonl -> 'sample-chat'),
#   3. preview the batch plan, 4. train examples/tiny_cpu_demo.py (2 workers: GPUs if present, else CPU/gloo),
#   5. print the run summary (steps, first/last loss, tokens/s, padding saved).
set -euo pipefail
cd "$(dirname "$0")/.."
config=examples/tiny_cpu_demo.py
hypersloth-tiny-model build/tiny-qwen3
hypersloth-build-dataset --local_path data/sample_chat.jsonl --name sample-chat \
  --tokenizer build/tiny-qwen3 --max_seq_length 1024 --overwrite
hypersloth-plan "$config"
hypersloth-train "$config" --overwrite   # the demo starts clean each time
echo
echo "demo done: outputs/tiny-demo holds the adapter, checkpoints, report.md/report.png and per-rank logs."
echo "next, in your shell (the hypersloth-* commands are in .venv):"
echo "  source .venv/bin/activate"
echo "  hypersloth-export outputs/tiny-demo --merge   # a merged Hugging Face model in outputs/tiny-demo/export"
echo "  hypersloth-init my_config.py                  # your own config (README: First run on a CPU)"
