"""SageMaker entry point for inference containers (SAGEMAKER_PROGRAM=inference.py).

`fish-sm package` writes this file as code/inference.py, with the fish_sm package beside
it; the stock PyTorch inference container imports it and calls the four contract functions.
"""

from fish_sm.serving.mms.errors import install_json_errors
from fish_sm.serving.mms.handler import input_fn, model_fn, output_fn, predict_fn

# The stock container's toolkit appends a traceback to error bodies; answer JSON instead.
install_json_errors()

__all__ = ["model_fn", "input_fn", "predict_fn", "output_fn"]
