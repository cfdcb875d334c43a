"""The AWS side of fish-sm: upload packages, deploy, autoscale, inspect and tear down SageMaker endpoints.

Nothing here imports torch (or the engine/serving packages), so these commands start fast
on a laptop with no GPU. boto3 is imported inside the functions that talk to AWS, and
nothing here prints: progress and notes go to the callbacks the caller passes.
Layers depend downward: session -> s3 -> package; session -> instances, images (what EC2
and ECR say about --instance-type and --image); naming -> container, alarms, endpoints ->
autoscaling -> deploy_request -> deploy; status, delete, fleet (list, scale), logs and
transform beside deploy; adapters (an endpoint's LoRA adapters: packaged and in its S3 source)
below deploy, which sets that source.
"""

from typing import Callable

from fish_sm.errors import FishSMError

Log = Callable[[str], None]  # one line of progress or a note, for the caller to show


def quiet(_: str) -> None:
    """The Log that shows nothing."""


class AWSError(FishSMError):
    """AWS or an endpoint refused or failed what we asked, with a one-line message for the user."""


__all__ = ["AWSError", "Log", "quiet"]
