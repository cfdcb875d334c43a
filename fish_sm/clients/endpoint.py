"""A SageMaker endpoint: real-time InvokeEndpoint, InvokeEndpointWithResponseStream for
streamed answers (PayloadPart events), either on one inference component, waiting while a
scaled-to-zero component gets a copy, and asynchronous inference through S3."""

from __future__ import annotations

import json
import time
import uuid

from fish_sm.aws import AWSError, Log, quiet
from fish_sm.aws.endpoints import describe_endpoint, endpoint_config, require_endpoint
from fish_sm.aws.s3 import S3Uri, get_bytes, head_object, parse_s3_uri, put_bytes
from fish_sm.aws.session import AWS, error_code, error_message
from fish_sm.clients.response import Response, ServiceError, error_text
from fish_sm.clients.stream import stream_response


SERVING_STATES = ("InService", "Updating", "SystemUpdating")
_DENIED = ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "NotAuthorized")


def denied(exc: BaseException) -> bool:
    """The call was refused for want of permission (a role allowed only to invoke)."""
    return error_code(exc) in _DENIED


def endpoint_problem(aws: AWS, name: str) -> str | None:
    """Why endpoint NAME cannot answer, if DescribeEndpoint says so: it does not exist, or is not
    in service. None when it looks fine or cannot be described (a role allowed only to invoke)."""
    try:
        ep = describe_endpoint(aws, name)
    except Exception:
        return None
    if ep is None:
        return f"endpoint {name!r} does not exist in {aws.region_name}"
    if ep["EndpointStatus"] not in SERVING_STATES:
        reason = ep.get("FailureReason")
        return f"endpoint {name} is {ep['EndpointStatus']}" + (f": {reason}" if reason else "")
    return None


def endpoint_instances(aws: AWS, name: str) -> str:
    """What endpoint NAME runs on ("2 x ml.g5.xlarge"), for a benchmark's report; an endpoint that
    does not exist or is not in service is an error; "unknown" when the role may not describe it."""
    try:
        ep = require_endpoint(aws, name)
    except Exception as exc:
        if denied(exc):
            return "unknown"
        raise
    if ep["EndpointStatus"] not in SERVING_STATES:
        reason = ep.get("FailureReason")
        raise AWSError(f"endpoint {name} is {ep['EndpointStatus']}" + (f": {reason}" if reason else ""))
    try:
        variants = endpoint_config(aws, ep)["ProductionVariants"]
    except Exception as exc:
        if denied(exc):
            return "unknown"
        raise
    live = {v["VariantName"]: v for v in ep.get("ProductionVariants", [])}
    parts = []
    for v in variants:
        if "InstanceType" not in v:
            parts.append(f"serverless ({v.get('ServerlessConfig', {}).get('MemorySizeInMB', '?')} MB)")
            continue
        count = live.get(v["VariantName"], {}).get("CurrentInstanceCount", v.get("InitialInstanceCount"))
        parts.append(f"{count} x {v['InstanceType']}" if count is not None else v["InstanceType"])
    return ", ".join(parts) or "unknown"


class EndpointTarget:
    """Real-time invoke_endpoint on one endpoint (and one of its inference components); safe to
    share across threads.

    Nothing is described first: a role allowed only to invoke can invoke (endpoint_problem
    explains a failure afterwards where it may)."""

    def __init__(self, aws: AWS, name: str, component: str | None = None):
        self.aws, self.name, self.component = aws, name, component

    def __str__(self) -> str:
        return f"endpoint {self.name}" + (f" component {self.component}" if self.component else "")

    def send(self, request: dict, accept: str = "audio/wav") -> Response:
        """invoke_endpoint; invoke_endpoint_with_response_stream when the request says "stream"."""
        data = json.dumps(request).encode()
        call = dict(EndpointName=self.name, Body=data, ContentType="application/json", Accept=accept)
        if self.component:
            call["InferenceComponentName"] = self.component
        t0 = time.perf_counter()
        try:
            if request.get("stream"):
                r = self.aws.runtime.invoke_endpoint_with_response_stream(**call)
                parts = (event["PayloadPart"].get("Bytes", b"") for event in r["Body"] if "PayloadPart" in event)
                return stream_response(parts, r.get("ContentType", accept), t0, request.get("sample_rate"))
            r = self.aws.runtime.invoke_endpoint(**call)
            body = r["Body"].read()
        except Exception as exc:
            raise _runtime_error(exc, self.name, self.component) from None
        return Response(body, r.get("ContentType", accept), time.perf_counter() - t0,
                        sample_rate=request.get("sample_rate"))


# The kind of ServiceError for a call that found a scaled-to-zero inference component with no copy.
NO_CAPACITY = "no capacity"
# While a copy starts (an instance, then the model's download and warm-up: minutes), retry at
# growing intervals: soon at first, then no more than once a minute.
CAPACITY_FIRST_DELAY_S = 5.0
CAPACITY_MAX_DELAY_S = 60.0


def send_when_capacity(target, request: dict, accept: str = "audio/wav", *, wait_s: float = 600.0,
                       log: Log = quiet) -> Response:
    """target.send, retried with exponential backoff for up to wait_s while the component has no
    copy (SageMaker's alarm on that failed call is adding one); one line says it waits."""
    t0 = None  # the wait starts at the first answer that there is no copy
    delay = CAPACITY_FIRST_DELAY_S
    said = False
    while True:
        try:
            return target.send(request, accept)
        except ServiceError as exc:
            if exc.kind != NO_CAPACITY or wait_s <= 0:
                raise
            t0 = time.monotonic() if t0 is None else t0
            waited = time.monotonic() - t0
            if waited >= wait_s:
                raise ServiceError(f"{target} still has no copy to serve the call after waiting {int(waited)} s; "
                                   "try again later, or add copies with `fish-sm scale`",
                                   NO_CAPACITY, exc.status) from None
            if not said:
                log(f"{target} has no copy running (scaled to zero): waiting up to {int(wait_s)} s for capacity, "
                    "retrying with backoff")
                said = True
            time.sleep(min(delay, wait_s - waited))
            delay = min(delay * 2, CAPACITY_MAX_DELAY_S)


def _runtime_error(exc: Exception, name: str, component: str | None = None) -> Exception:
    """Map botocore errors from sagemaker-runtime to ServiceError with a kind for statistics.

    A stream that fails after it began raises ModelStreamError or InternalStreamFailure while
    its events are read; those become ServiceErrors of that kind like any other code. A call that
    finds an inference component with no copy is a ValidationError (SageMaker: "Inference Component
    has no capacity to process this request"): kind NO_CAPACITY, which invoke waits out.
    """
    what = f"endpoint {name}" + (f" component {component}" if component else "")
    code = error_code(exc)
    if code in ("ValidationError", "ModelError") and "no capacity" in error_message(exc).lower():
        return ServiceError(f"{what} has no copy to serve the call (scaled to zero); SageMaker adds one when "
                            f"the component's no-capacity alarm fires, in minutes: {error_message(exc)}",
                            NO_CAPACITY, 400)
    if code == "ModelError":
        status = exc.response.get("OriginalStatusCode")
        original = exc.response.get("OriginalMessage") or error_message(exc)
        text = error_text(original)
        # SageMaker relays the status and body, not the headers: the server's 503 says "retry after".
        kind = "rejected" if status == 503 and "retry after" in text.lower() else f"HTTP {status}"
        return ServiceError(f"{what} answered {status}: {text}", kind, status)
    if code:
        return ServiceError(f"{what}: {code}: {error_message(exc)}", code)
    name_ = type(exc).__name__
    if "Timeout" in name_:
        return ServiceError(f"{what}: no answer in time ({exc})", "timeout")
    if "Connect" in name_:
        return ServiceError(f"{what}: cannot connect ({exc})", "connection")
    return exc


def invoke_async(aws: AWS, name: str, request: dict, accept: str = "audio/wav", *,
                 input_location: S3Uri | None = None, timeout_s: float = 900, poll_s: float = 5.0,
                 log: Log = quiet) -> Response:
    """Upload the request, invoke_endpoint_async, and wait for the output or failure object.

    Without input_location the endpoint's config is read for its output bucket (the endpoint's
    role can already read that bucket); with it, nothing is described first."""
    if input_location is None:
        try:
            async_config = endpoint_config(aws, require_endpoint(aws, name)).get("AsyncInferenceConfig")
        except Exception as exc:
            if denied(exc):
                raise AWSError(f"may not describe endpoint {name} to find its output bucket "
                               f"({error_code(exc)}): give --input-location s3://...") from None
            raise
        if not async_config:
            raise AWSError(f"endpoint {name} is real-time; leave out --async")
        output = parse_s3_uri(async_config["OutputConfig"]["S3OutputPath"], prefix=True)
        input_location = S3Uri(output.bucket, "fish-sm/async-inputs/")
    source = input_location.join(f"{uuid.uuid4().hex}.json")
    put_bytes(aws, source, json.dumps(request).encode(), "application/json")
    t0 = time.perf_counter()
    try:
        r = aws.runtime.invoke_endpoint_async(EndpointName=name, InputLocation=str(source),
                                              ContentType="application/json", Accept=accept)
    except Exception as exc:
        raise _runtime_error(exc, name) from None
    output = parse_s3_uri(r["OutputLocation"], what="OutputLocation", prefix=False)
    failure = parse_s3_uri(r["FailureLocation"], what="FailureLocation", prefix=False) if r.get("FailureLocation") else None
    log(f"queued {r.get('InferenceId', '')}: request {source}, result {output}")
    while True:
        head = head_object(aws, output)
        if head is not None:
            return Response(get_bytes(aws, output), head.get("ContentType") or "",
                            time.perf_counter() - t0)
        if failure is not None and head_object(aws, failure) is not None:
            raise ServiceError(f"endpoint {name} failed the request: {error_text(get_bytes(aws, failure))}",
                               "async failure")
        if time.perf_counter() - t0 > timeout_s:
            raise AWSError(f"no result after {int(timeout_s)} s; it will appear at {output}")
        time.sleep(poll_s)
