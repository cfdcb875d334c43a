"""The AWS side stays light: no torch ever, no boto3 until a command talks to AWS."""

import subprocess
import sys

from click.testing import CliRunner

from fish_sm.cli import main


def test_aws_modules_never_import_torch_and_help_imports_no_boto3():
    code = (
        "import sys\n"
        "from fish_sm.cli import main\n"
        "assert not {'torch', 'boto3', 'botocore', 'matplotlib'} & set(sys.modules), 'cli'\n"
        "import fish_sm.aws.session, fish_sm.aws.s3, fish_sm.aws.package, fish_sm.aws.deploy\n"
        "import fish_sm.aws.invoke, fish_sm.aws.bench, fish_sm.aws.transform\n"
        "import boto3, botocore.stub\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('fish_sm.model', 'fish_sm.engine', 'fish_sm.serving'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_lists_the_aws_commands():
    result = CliRunner().invoke(main, ["--help"])
    for command in ("package", "deploy", "invoke", "bench", "transform", "status", "delete"):
        assert f"  {command} " in result.output
    for command in ("package", "deploy", "invoke", "bench", "transform", "status", "delete"):
        result = CliRunner().invoke(main, [command, "--help"])
        assert result.exit_code == 0 and "--region" in result.output and "--endpoint-url" in result.output
