"""The SageMaker side of one container: the runtime (requests in, audio out) and the two servers on it."""
