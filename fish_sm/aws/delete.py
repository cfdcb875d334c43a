"""`fish-sm delete`: remove an endpoint and everything deploys of it made; safe to repeat."""

from __future__ import annotations

from fish_sm.aws import AWSError
from fish_sm.aws.alarms import delete_alarms, list_alarms
from fish_sm.aws.autoscaling import remove_autoscaling
from fish_sm.aws.dashboard import delete_dashboard
from fish_sm.aws.endpoints import describe_endpoint, endpoint_config
from fish_sm.aws.naming import alarm_prefix, check_name, owned
from fish_sm.aws.session import AWS, is_not_found


def _owned_names(pages, list_key: str, name_key: str, name: str) -> list[str]:
    return sorted(item[name_key] for page in pages for item in page.get(list_key, []) if owned(name, item[name_key]))


def _delete_components(aws: AWS, name: str, endpoint: dict, poll_s: float) -> list[str]:
    """An endpoint holding inference components cannot be deleted until they are gone."""
    from fish_sm.aws.components import delete_components, is_component_endpoint

    try:
        config = endpoint_config(aws, endpoint)
    except Exception as exc:
        if is_not_found(exc):  # its config was deleted by hand: then it holds no components we know of
            return []
        raise
    return delete_components(aws, name, poll_s=poll_s) if is_component_endpoint(config) else []


def delete(aws: AWS, name: str, *, wait: bool = False, poll_s: float = 15.0, max_attempts: int = 120) -> list[str]:
    """Remove the endpoint and what deploys of it made (its inference components first, waiting until
    they are gone); returns what was removed ([] if nothing).
    With wait, return once SageMaker has finished deleting the endpoint (its instances are gone)."""
    check_name(name)
    sm, done = aws.sagemaker, []
    done += remove_autoscaling(aws, name)
    done += delete_alarms(aws, [a["AlarmName"] for a in list_alarms(aws, alarm_prefix(name))])
    done += delete_dashboard(aws, name)
    endpoint = describe_endpoint(aws, name)
    if endpoint is not None:
        done += _delete_components(aws, name, endpoint, poll_s)
        sm.delete_endpoint(EndpointName=name)
        done.append(f"removed endpoint {name}")
        if wait:
            from botocore.exceptions import WaiterError

            try:
                sm.get_waiter("endpoint_deleted").wait(EndpointName=name,
                                                       WaiterConfig={"Delay": poll_s, "MaxAttempts": max_attempts})
            except WaiterError as exc:
                raise AWSError(f"endpoint {name} was not deleted: {exc.kwargs.get('reason') or exc}") from None
    configs = _owned_names(sm.get_paginator("list_endpoint_configs").paginate(NameContains=name),
                           "EndpointConfigs", "EndpointConfigName", name)
    for config in configs:
        sm.delete_endpoint_config(EndpointConfigName=config)
        done.append(f"removed endpoint config {config}")
    for model in _owned_names(sm.get_paginator("list_models").paginate(NameContains=name), "Models", "ModelName", name):
        sm.delete_model(ModelName=model)
        done.append(f"removed model {model}")
    return done
