#!/usr/bin/env bash
# The transformers 4.x leg: the Hugging Face exactness tests again, under transformers 4.57.
# Users run both lines (4.x and 5.x build masks, rotary embeddings and attention differently:
# 4.57's GPT-2 builds its masks with torch.vmap, its Llama turns autocast off locally), so
# both are tested. A second virtual environment, .venv4, beside the main one.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv4
. .venv4/bin/activate
pip install torch==2.13.0
pip install -e ".[dev]" "transformers==4.57.*"
python -m pytest -q -n 2 --dist loadgroup -m hf tests/test_zoo.py tests/test_precision.py tests/test_shapes.py \
    tests/test_evaluate.py tests/test_api_state.py tests/test_train_llama.py tests/test_branching.py \
    tests/test_backend_hf.py
# the composition matrix (Qwen2 through every entry point with every feature), as under 5.x
python -m pytest -q -n 2 --dist loadgroup tests/test_matrix.py
