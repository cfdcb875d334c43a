"""One boto3 session and its clients, built from the --region/--profile/--endpoint-url options.

Every command takes the same three options, so they all go through `AWS`. `--endpoint-url`
points every service at one URL (a moto server, LocalStack, a VPC endpoint proxy), which is
how the tests reach a fake AWS over real HTTP.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from fish_sm import __version__
from fish_sm.aws import AWSError

# Real-time invocations can take minutes for long texts; inference is never retried, so a
# benchmark counts exactly the requests it sent and a failed synthesis is not run twice.
_RUNTIME_READ_TIMEOUT_S = 900


@dataclass
class AWS:
    """Lazily created clients sharing one session; clients are thread-safe, the session is not."""

    region: str | None = None
    profile: str | None = None
    endpoint_url: str | None = None
    max_pool_connections: int = 10
    _session: object | None = field(default=None, repr=False)
    _clients: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if self.endpoint_url is not None and not re.match(r"^https?://[^\s/]+", self.endpoint_url):
            raise AWSError(f"--endpoint-url must be an http(s) URL, got {self.endpoint_url!r}")

    @property
    def session(self):
        if self._session is None:
            import boto3

            self._session = boto3.Session(region_name=self.region, profile_name=self.profile)
        return self._session

    @property
    def region_name(self) -> str:
        name = self.session.region_name
        if not name:
            raise AWSError("no AWS region: pass --region or set AWS_REGION / a profile's region")
        return name

    def client(self, service: str, region: str | None = None):
        """A client for `service` (cached), pointed at --endpoint-url when given; `region` for a
        resource that lives elsewhere (an ECR image in another region)."""
        key = service if region is None or region == self.region_name else (service, region)
        with self._lock:
            if key not in self._clients:
                self._clients[key] = self._make_client(service, region)
            return self._clients[key]

    def _make_client(self, service: str, region: str | None = None):
        from botocore.config import Config

        options = dict(
            user_agent_extra=f"fish-sm/{__version__}",
            max_pool_connections=self.max_pool_connections,
            retries={"mode": "standard", "max_attempts": 5},
        )
        if service == "sagemaker-runtime":
            options.update(read_timeout=_RUNTIME_READ_TIMEOUT_S, retries={"mode": "standard", "total_max_attempts": 1})
        if service == "s3" and self.endpoint_url:
            options["s3"] = {"addressing_style": "path"}  # a bare host:port has no bucket subdomains
        return self.session.client(service, region_name=region or self.region_name, endpoint_url=self.endpoint_url,
                                   config=Config(**options))

    @property
    def sagemaker(self):
        return self.client("sagemaker")

    @property
    def runtime(self):
        return self.client("sagemaker-runtime")

    @property
    def s3(self):
        return self.client("s3")

    @property
    def autoscaling(self):
        return self.client("application-autoscaling")

    @property
    def cloudwatch(self):
        return self.client("cloudwatch")

    @property
    def ec2(self):
        return self.client("ec2")

    @property
    def logs(self):
        return self.client("logs")


def error_code(exc: BaseException) -> str:
    """The AWS error code of a botocore ClientError ('' for anything else)."""
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def error_message(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Message", "")) or str(exc)


def is_not_found(exc: BaseException) -> bool:
    """SageMaker says 'not found' as a ValidationException whose message says so."""
    code = error_code(exc)
    if code in ("ResourceNotFound", "ResourceNotFoundException", "NoSuchKey", "NoSuchBucket", "404", "NotFound"):
        return True
    message = error_message(exc).lower()
    return code == "ValidationException" and ("could not find" in message or "not found" in message)
