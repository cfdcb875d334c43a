"""The SageMaker side of one container: requests in, audio out, behind the model server."""
