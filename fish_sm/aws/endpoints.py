"""Reading an endpoint: describe it, its config, and wait until it is InService or has failed."""

from __future__ import annotations

import time

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.naming import check_name
from fish_sm.aws.session import AWS, is_not_found


def describe_or_none(describe, **kwargs) -> dict | None:
    """A SageMaker Describe* call's answer, or None when the resource does not exist."""
    try:
        return describe(**kwargs)
    except Exception as exc:
        if is_not_found(exc):
            return None
        raise


def describe_endpoint(aws: AWS, name: str) -> dict | None:
    return describe_or_none(aws.sagemaker.describe_endpoint, EndpointName=name)


def require_endpoint(aws: AWS, name: str) -> dict:
    """describe_endpoint, or a one-line error naming the endpoint and region."""
    check_name(name)
    found = describe_endpoint(aws, name)
    if found is None:
        raise AWSError(f"endpoint {name!r} does not exist in {aws.region_name}")
    return found


def endpoint_config(aws: AWS, endpoint: dict) -> dict:
    return aws.sagemaker.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])


FAILED_STATES = ("Failed", "UpdateRollbackFailed", "OutOfService")


def wait_endpoint(aws: AWS, name: str, *, config_name: str | None = None, poll_s: float = 15.0,
                  timeout_s: float = 2 * 3600, log: Log = quiet) -> dict:
    """Poll until InService; on failure raise with SageMaker's FailureReason.

    With config_name (an update), coming back InService on another config means the update
    was rolled back, which is a failure too.
    """
    t0 = time.monotonic()
    last, last_line = None, t0
    while True:
        desc = describe_endpoint(aws, name)
        elapsed = time.monotonic() - t0
        if desc is None:
            raise AWSError(f"endpoint {name} disappeared while waiting (deleted?)")
        status = desc["EndpointStatus"]
        if status != last or time.monotonic() - last_line >= 60:
            log(f"[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] {name}: {status}"
                + (" (still)" if status == last else ""))
            last, last_line = status, time.monotonic()
        reason = desc.get("FailureReason")
        if status == "InService":
            if config_name and desc.get("EndpointConfigName") != config_name:
                raise AWSError(f"the update of {name} was rolled back ({reason or 'the rollback alarm fired'}); "
                               f"it still serves {desc.get('EndpointConfigName')}")
            return desc
        if status in FAILED_STATES:
            raise AWSError(f"endpoint {name} is {status}: {reason or 'SageMaker gave no reason'}")
        if elapsed > timeout_s:
            raise AWSError(f"gave up after {int(elapsed)} s: endpoint {name} is still {status} "
                           f"(see `fish-sm status {name}`)")
        time.sleep(poll_s)
