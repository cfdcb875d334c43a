"""Clients of a running server or endpoint: send one request (`invoke`), load-test (`bench`).

Requests are built by the contract (fish_sm.contract) and go over plain HTTP to `fish-sm
serve` (or any server with SageMaker's container contract), or through SageMaker's runtime
with boto3 by way of fish_sm.aws. Nothing here imports torch.
"""
