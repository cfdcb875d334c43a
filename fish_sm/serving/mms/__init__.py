"""The model server's side: sagemaker-inference's multi-model server (or the stock container's) around the runtime."""
