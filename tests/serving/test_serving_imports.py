"""Import direction: the batching server stands on the runtime alone, and package/ never reaches up into serving/."""

import subprocess
import sys


def run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_batching_server_imports_nothing_from_the_model_server_side():
    run("import sys\n"
        "import fish_sm.serving.batching_server\n"
        "assert 'sagemaker_inference' not in sys.modules\n"
        "bad = [m for m in sys.modules if m == 'mms' or m.startswith(('fish_sm.serving.mms', 'mms.'))]\n"
        "assert not bad, bad\n")


def test_package_modules_import_no_serving_module():
    run("import sys\n"
        "import fish_sm.package.build, fish_sm.package.voices, fish_sm.package.verify\n"
        "bad = [m for m in sys.modules if m.startswith('fish_sm.serving')]\n"
        "assert not bad, bad\n")


def test_the_batching_servers_front_end_imports_no_torch():
    """The process that serves HTTP leaves torch to its engine cores (issue 42)."""
    run("import sys\n"
        "import fish_sm.cli.serve, fish_sm.serving.batching_server, fish_sm.serving.bidi, fish_sm.serving.cores\n"
        "import fish_sm.serving.ipc, fish_sm.serving.response, fish_sm.serving.references, fish_sm.serving.config\n"
        "import fish_sm.serving.adapters, fish_sm.serving.errors, fish_sm.serving.metrics\n"
        "import fish_sm.engine.audio, fish_sm.engine.text, fish_sm.engine\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'fish_sm.model.lora',\n"
        "       'fish_sm.engine.engine', 'fish_sm.engine.batching', 'fish_sm.serving.runtime', 'fish_sm.serving.core'))\n"
        "       and m != 'fish_sm.serving.cores']\n"
        "assert not bad, bad\n"
        "from fish_sm.engine import Engine\n"  # lazily, where torch is wanted
        "assert 'torch' in sys.modules and Engine.__name__ == 'Engine'\n")
