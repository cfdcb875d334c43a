"""The CloudWatch metrics fish-sm's servers publish, by name: what the servers write (as
Embedded Metric Format lines, fish_sm.serving.metrics) and what deploy's dashboard and alarms
and `fish-sm metrics` read (fish_sm.aws) must agree on, so both take them from here. Plain
data: no torch, no boto3.
"""

from __future__ import annotations

NAMESPACE = "fish-sm"
# Every metric carries these two dimensions, and only these: CloudWatch bills per metric, and
# one set keeps a dashboard's and an alarm's query to one series per endpoint and server.
ENDPOINT_DIMENSION = "EndpointName"
SERVER_DIMENSION = "Server"  # batching | mms
DIMENSIONS = (ENDPOINT_DIMENSION, SERVER_DIMENSION)
# A few request metrics are also kept per LoRA adapter, under both and this (fish_sm.serving.metrics).
ADAPTER_DIMENSION = "Adapter"
# deploy puts the endpoint's name in the container's environment under this variable (not a
# FISH_SM_ setting, which an older image would refuse); a server without it reports "local".
ENDPOINT_ENV = "SAGEMAKER_ENDPOINT_NAME"
LOCAL_ENDPOINT = "local"

# One line per request answered. Latency from the request's arrival until its answer was done
# (written, for a stream); FirstAudio only for streamed requests that sent audio; RealTimeFactor,
# Frames, AudioSeconds only for requests with audio; QueueWait where the server queues (the
# batching server's queue; the mms server's until a worker took it). Requests is 1 on every
# line, so Sum(Rejected) / Sum(Requests) is the rejection rate.
REQUEST_METRICS = {
    "Requests": "Count",
    "Latency": "Milliseconds",
    "FirstAudio": "Milliseconds",
    "RealTimeFactor": "None",
    "Frames": "Count",
    "AudioSeconds": "Seconds",
    "QueueWait": "Milliseconds",
    "Rejected": "Count",  # 503 because the server was full (batching: Retry-After; mms: no worker or connection free)
    "Errors": "Count",  # any other 5xx
    # On lines of requests that used a LoRA adapter: 1 when it could not be read or served (its
    # download, checksum or tensors; a 422), which deploy's adapter alarm watches.
    "AdapterErrors": "Count",
}
# A line every STATE_INTERVAL_S seconds from the batching server: its engines together.
STATE_METRICS = {
    "BatchOccupancy": "Percent",  # active / slots
    "ActiveRequests": "Count",
    "QueueDepth": "Count",
    "Slots": "Count",
    "FreeKVMemory": "Bytes",  # only when the engine reports it
}
STATE_INTERVAL_S = 10.0
