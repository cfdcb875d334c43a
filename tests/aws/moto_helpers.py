"""moto's standalone server for the AWS tests, with AWS settings isolated from this machine's."""

import contextlib
import urllib.request

import pytest


@contextlib.contextmanager
def moto_server(tmp_path_factory):
    """moto's standalone server on loopback, with AWS settings from nowhere else (no profile,
    no real credentials, an empty config). Yields its URL."""
    from moto.server import ThreadedMotoServer

    empty = tmp_path_factory.mktemp("aws-home")
    with pytest.MonkeyPatch.context() as mp:
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION"):
            mp.delenv(key, raising=False)
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(empty / "config"),
                           "AWS_SHARED_CREDENTIALS_FILE": str(empty / "credentials")}.items():
            mp.setenv(key, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        # moto's state belongs to the process, not the server: start each module from nothing.
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30).close()
        try:
            yield url
        finally:
            server.stop()
