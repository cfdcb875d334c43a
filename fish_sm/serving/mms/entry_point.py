"""SageMaker entry point for inference containers (SAGEMAKER_PROGRAM=inference.py).

`fish-sm package` writes this file as code/inference.py, with the fish_sm package beside
it; the stock PyTorch inference container imports it and calls the four contract functions.
"""

import os
import sys

# A package built with `fish-sm package --stock-container` carries its dependencies in code/lib
# (and no requirements.txt), so the container starts without network; they come first.
_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")
if os.path.isdir(_LIB) and _LIB not in sys.path:
    sys.path.insert(0, _LIB)

from fish_sm.serving.mms.errors import install_json_errors  # noqa: E402
from fish_sm.serving.mms.handler import input_fn, model_fn, output_fn, predict_fn  # noqa: E402

# The stock container's toolkit appends a traceback to error bodies; answer JSON instead.
install_json_errors()

__all__ = ["model_fn", "input_fn", "predict_fn", "output_fn"]
