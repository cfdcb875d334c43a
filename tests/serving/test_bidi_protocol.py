"""The bidirectional session's parts that need no server: sentence splitting, the image label,
the endpoint client over a scripted stand-in of AWS's HTTP/2 client (its parts, their reassembly,
retries at the start, errors in one line), and its one-line error where that client is missing."""

import asyncio
import dataclasses
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from fish_sm.cli import main
from fish_sm.clients.bidi import SDK_PACKAGE, BidiError, EndpointChannel, endpoint_parts, split_pieces
from fish_sm.serving.bidi import SentenceBuffer

REPO = Path(__file__).resolve().parents[2]


def feed(pieces):
    buffer, out = SentenceBuffer(), []
    for piece in pieces:
        out.append(buffer.add(piece))
    return out, buffer


def test_sentences_end_at_punctuation_before_space_or_the_end_of_a_part():
    out, buffer = feed(["Hel", "lo there. How a", "re you? It costs 3.", "5 dollars.", "Next一句。好", "\nok"])
    assert out == [[], ["Hello there."], ["How are you?"], ["It costs 3.5 dollars."], ["Next一句。"], ["好"]]
    assert buffer.flush() == ["ok"] and buffer.flush() == []


def test_a_part_may_hold_several_sentences_and_mid_word_splits_join():
    text = "One. Two! Three? Four… five"
    assert sum(feed(split_pieces(text, 3))[0], []) == ["One.", "Two!", "Three?", "Four…"]
    assert feed([text])[0] == [["One.", "Two!", "Three?", "Four…"]]


def test_the_image_declares_bidirectional_streaming():
    lines = (REPO / "deploy" / "Dockerfile").read_text().splitlines()
    assert "LABEL com.amazonaws.sagemaker.capabilities.bidirectional-streaming=true" in lines


def test_endpoint_parts_are_whole_utf8_messages_each_complete():
    """The service joins PARTIAL parts with what follows into one message: each of ours is COMPLETE."""
    parts = endpoint_parts(['{"voice": "narrator"}', "Héllo. ", '{"end": true}'])
    assert [p["Bytes"].decode() for p in parts] == ['{"voice": "narrator"}', "Héllo. ", '{"end": true}']
    assert {p["DataType"] for p in parts} == {"UTF8"}
    assert {p["CompletionState"] for p in parts} == {"COMPLETE"}


class FakeSDK:
    """The surface of AWS's HTTP/2 client that `EndpointChannel` uses, over a scripted stream: the
    session's start fails `throttled` times, then the response parts come as given."""

    def __init__(self, responses, throttled=0, start_error=None):
        self.responses, self.throttled, self.start_error = list(responses), throttled, start_error
        self.sent, self.starts, self.config = [], 0, None
        sdk = self

        @dataclasses.dataclass
        class Part:
            bytes_: bytes
            data_type: str
            completion_state: str | None = None

        @dataclasses.dataclass
        class Event:
            value: object

        @dataclasses.dataclass
        class Identity:
            access_key_id: str
            secret_access_key: str
            session_token: str | None

        class Input:
            def __init__(self, **kwargs):
                self.kwargs = kwargs

        self.models = types.SimpleNamespace(RequestPayloadPart=Part, ResponsePayloadPart=Part,
                                            RequestStreamEventPayloadPart=Event, AWSCredentialsIdentity=Identity,
                                            InvokeEndpointWithBidirectionalStreamInput=Input)

        class Config:
            def __init__(self, **kwargs):
                sdk.config = kwargs

        class Output:
            async def receive(self):
                return sdk.responses.pop(0) if sdk.responses else None

        class InputStream:
            async def send(self, event):
                sdk.sent.append(event.value)

            async def close(self):
                pass

        class Stream:
            input_stream = InputStream()

            async def await_output(self):
                return None, Output()

        class Client:
            def __init__(self, config):
                pass

            async def invoke_endpoint_with_bidirectional_stream(self, request):
                sdk.starts += 1
                if sdk.start_error is not None:
                    raise sdk.start_error
                if sdk.starts <= sdk.throttled:
                    raise ThrottlingException("Rate exceeded")
                return Stream()

        self.modules = (types.SimpleNamespace(SageMakerRuntimeHTTP2Client=Client), types.SimpleNamespace(Config=Config),
                        self.models)

    def part(self, data: bytes, data_type: str, completion: str | None):
        return types.SimpleNamespace(value=self.models.ResponsePayloadPart(data, data_type, completion))


class ThrottlingException(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.message = message


class ValidationError(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.message = message


class ModelStreamError:
    message, error_code = "the model\ncrashed", "ModelError"


class FakeAWS:
    """What `EndpointChannel` reads of `aws.session.AWS`: region, endpoint URL, a credentials session."""

    region_name, endpoint_url = "eu-west-1", None

    class session:
        @staticmethod
        def get_credentials():
            frozen = types.SimpleNamespace(access_key="AKIA-PROFILE", secret_key="secret", token="token")
            return types.SimpleNamespace(get_frozen_credentials=lambda: frozen)


def test_the_endpoint_channel_retries_its_start_sends_complete_parts_and_joins_partial_ones():
    sdk = FakeSDK([], throttled=2)
    sdk.responses = [sdk.part(b'{"ready": tr', "UTF8", "PARTIAL"), sdk.part(b'ue}', "UTF8", "COMPLETE"),
                     sdk.part(b"\x01\x02", "BINARY", "PARTIAL"), sdk.part(b"\x03", "BINARY", None),
                     sdk.part(b'{"done": {}}', "UTF8", None)]
    delays = []

    async def no_wait(seconds):
        delays.append(seconds)

    async def go():
        channel = EndpointChannel("tts", FakeAWS(), sdk=sdk.modules)
        channel.retry_sleep = no_wait
        async with channel:
            await channel.send('{"voice": "narrator"}')
            await channel.send('{"end": true}', last=True)
            identity = await sdk.config["aws_credentials_identity_resolver"].get_identity(identity_properties={})
            return [await channel.receive() for _ in range(4)], identity

    got, identity = asyncio.run(go())
    assert sdk.starts == 3 and len(delays) == 2 and delays[1] > delays[0]  # two throttled starts, backing off
    assert sdk.config["region"] == "eu-west-1" and sdk.config["endpoint_uri"].startswith("https://runtime.sagemaker.eu-west-1")
    assert identity.access_key_id == "AKIA-PROFILE" and identity.session_token == "token"  # the session's, not the env's
    assert [p.completion_state for p in sdk.sent] == ["COMPLETE", "COMPLETE"]
    assert got == [("text", '{"ready": true}'), ("binary", b"\x01\x02\x03"), ("text", '{"done": {}}'), None]


@pytest.mark.parametrize("error, parts, message", [
    (ValidationError("Endpoint tts\nnot found"), [], "the endpoint refused the session: ValidationError: Endpoint tts not found"),
    (None, ["stream error"], "the endpoint's stream failed: ModelStreamError (ModelError): the model crashed"),
    (None, ["mixed"], "the endpoint split a message across UTF8 and BINARY parts"),
])
def test_endpoint_errors_are_one_line(error, parts, message):
    sdk = FakeSDK([], start_error=error)
    if parts == ["stream error"]:
        sdk.responses = [types.SimpleNamespace(value=ModelStreamError())]
    elif parts == ["mixed"]:
        sdk.responses = [sdk.part(b"{", "UTF8", "PARTIAL"), sdk.part(b"x", "BINARY", "COMPLETE")]

    async def go():
        async with EndpointChannel("tts", FakeAWS(), sdk=sdk.modules) as channel:
            await channel.receive()

    with pytest.raises(BidiError) as info:
        asyncio.run(go())
    assert str(info.value) == message and sdk.starts == 1


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="AWS's HTTP/2 client may be installed on 3.12+")
def test_invoke_bidi_on_an_endpoint_says_what_is_missing(tmp_path):
    story = tmp_path / "story.txt"
    story.write_text("Hello.")
    result = CliRunner().invoke(main, ["invoke", "tts", "--bidi", str(story), "--region", "us-east-1"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: invoke --bidi against an endpoint needs AWS's {SDK_PACKAGE} client (it needs Python 3.12 or newer; "
        f"this is 3.11): pip install {SDK_PACKAGE}; or call a server with --url"]


@pytest.mark.parametrize("args, message", [
    (["--url", "http://x", "--bidi", "-", "Hello"], "give no TEXT"),
    (["--url", "http://x", "--bidi", "-", "--stream"], "not with --stream"),
    (["--url", "http://x", "--bidi", "nothing-here.txt"], "no such file"),
    (["--url", "http://x", "--bidi", "-", "-o", "x.mp3"], "writes wav, or bare pcm"),
])
def test_invoke_bidi_usage_errors(args, message):
    result = CliRunner().invoke(main, ["invoke", *args])
    assert result.exit_code == 2 and message in result.output


def test_bench_bidi_is_for_servers():
    result = CliRunner().invoke(main, ["bench", "tts", "--bidi"])
    assert result.exit_code == 2 and "--bidi benchmarks a server" in result.output
