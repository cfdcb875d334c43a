"""The one S3 client a server reads with (zero-shot references, adapters from their sources).

Made once per process, under a lock: boto3's default session is not safe to make clients from
several threads at once, and the requests that need S3 run on executor threads. The client
itself is thread-safe. It takes its region, credentials and endpoint from the environment
(the instance's role on SageMaker; `AWS_ENDPOINT_URL` for a local stand-in).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_client = None


def s3_client():
    global _client
    with _lock:
        if _client is None:
            import boto3
            from botocore.config import Config

            # Short connect and read timeouts: a request waits on this client, and S3 answers quickly or not at all.
            _client = boto3.session.Session().client(
                "s3", config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"}))
        return _client
