"""The names fish-sm gives what it makes for endpoint NAME, and how it finds them again.

Every deploy makes a new model and endpoint config named NAME-<UTC timestamp>, so an update
can be rolled back to the previous config, and `delete` finds everything a deploy made by
that naming (plus the fish-sm/NAME/ alarm prefix and the endpoint's scalable target).
"""

from __future__ import annotations

import re
import time

from fish_sm.errors import InputError

VARIANT = "AllTraffic"  # blue/green updates require the same variant name in the new config
TAG_KEY = "fish-sm:endpoint"

_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_STAMP_LEN = 17  # YYYYmmddHHMMSS + milliseconds
MAX_NAME = 63 - 1 - _STAMP_LEN


def check_name(name: str, *, for_deploy: bool = False) -> str:
    if not _NAME.match(name or ""):
        raise InputError(f"endpoint name {name!r} must be letters, digits and single or repeated '-' "
                         "between them, at most 63 characters")
    if for_deploy and len(name) > MAX_NAME:
        raise InputError(f"endpoint name {name!r} is {len(name)} characters; at most {MAX_NAME}, so that "
                         f"its model and config names (NAME-<timestamp>) fit SageMaker's 63")
    return name


def new_stamp() -> str:
    """UTC time to the millisecond: unique per deploy, and sorts by age."""
    now = time.time()
    return time.strftime("%Y%m%d%H%M%S", time.gmtime(now)) + f"{int(now * 1000) % 1000:03d}"


def owned(name: str, resource: str) -> bool:
    """Whether a model/config name is one a deploy of endpoint `name` made."""
    return re.fullmatch(re.escape(name) + r"-\d{%d}" % _STAMP_LEN, resource) is not None


def resource_id(name: str) -> str:
    return f"endpoint/{name}/variant/{VARIANT}"


def alarm_prefix(name: str) -> str:
    """What every CloudWatch alarm made for endpoint `name` starts with."""
    return f"fish-sm/{name}/"


def rollback_alarm_name(name: str) -> str:
    return f"{alarm_prefix(name)}invocation-5xx"


def wake_alarm_name(name: str) -> str:
    return f"{alarm_prefix(name)}has-backlog-without-capacity"
