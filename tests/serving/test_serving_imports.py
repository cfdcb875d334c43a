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
