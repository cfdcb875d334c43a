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
        "import importlib, pkgutil, fish_sm.aws\n"
        "for m in pkgutil.iter_modules(fish_sm.aws.__path__): importlib.import_module('fish_sm.aws.' + m.name)\n"
        "import boto3, botocore.stub\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('fish_sm.model', 'fish_sm.engine', 'fish_sm.serving'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_clients_contract_and_the_cli_group_import_no_torch_and_no_boto3():
    """The clients, the request contract and every command's options, built as `--help` builds them."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import click\n"
        "import fish_sm.cli, fish_sm.clients, fish_sm.contract\n"
        "main = fish_sm.cli.main\n"
        "for name in main.list_commands(click.Context(main)):\n"
        "    command = main.get_command(click.Context(main), name)\n"
        "    command.get_help(click.Context(command))\n"
        "for m in pkgutil.iter_modules(fish_sm.clients.__path__): importlib.import_module('fish_sm.clients.' + m.name)\n"
        "bad = [m for m in sys.modules if m in ('torch', 'boto3', 'botocore')\n"
        "       or m.startswith(('fish_sm.model', 'fish_sm.engine', 'fish_sm.serving'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_lists_the_aws_commands():
    result = CliRunner().invoke(main, ["--help"])
    commands = ("package", "deploy", "invoke", "bench", "transform", "list", "status", "logs", "scale", "delete")
    for command in commands:
        assert f"  {command} " in result.output
    for command in commands:
        result = CliRunner().invoke(main, [command, "--help"])
        assert result.exit_code == 0 and "--region" in result.output and "--endpoint-url" in result.output
