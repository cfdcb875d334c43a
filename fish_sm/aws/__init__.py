"""The AWS side of fish-sm: package, deploy, invoke, benchmark and tear down SageMaker endpoints.

Nothing here imports torch (or the engine/serving packages), so these commands start fast
on a laptop with no GPU. boto3 is imported inside the functions that talk to AWS.
Layers depend downward: session -> s3 -> package / deploy -> invoke -> bench / transform.
"""

from fish_sm.errors import FishSMError


class AWSError(FishSMError):
    """AWS or an endpoint refused or failed what we asked, with a one-line message for the user."""


__all__ = ["AWSError"]
