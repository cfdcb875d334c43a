"""A small package in the layout `fish-sm package` writes (manifest.json with a files table,
code/, weights), archived by the real make_tarball: what deploy accepts as --model-data."""

import hashlib
import json
import os
from pathlib import Path

from fish_sm.package.tarball import make_tarball


def make_package_dir(root: Path, weight_bytes: int = 1024, vendored: bool = False,
                     compile_cache: dict | None = None) -> Path:
    """A hand-made directory in the package layout (manifest.json + code/ mark it as built); vendored:
    the stock container's dependencies in code/lib instead of a requirements.txt; compile_cache: what
    a packaged compile cache's cache.json says it was built for."""
    files = {"config.json": b"{}", "model.pth": os.urandom(weight_bytes), "codec.pth": b"\x02" * 100,
             "tokenizer.tiktoken": b"", "special_tokens.json": b"{}", "code/inference.py": b"# handler\n",
             "voices/alice/transcript.txt": b"Hi."}
    files.update({"code/lib/soundfile.py": b"# vendored\n"} if vendored else {"code/requirements.txt": b""})
    if compile_cache is not None:
        files["compile_cache/cache.json"] = json.dumps(compile_cache).encode()
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    listed = {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in files.items()}
    (root / "manifest.json").write_text(json.dumps({"format": 1, "files": listed, "compile_cache": compile_cache}))
    return root


def package_tarball(root: Path, vendored: bool = False, compile_cache: dict | None = None) -> tuple[bytes, bytes]:
    """(model.tar.gz's bytes, its manifest.json's bytes) of a fresh package under `root`."""
    src = make_package_dir(root / "package", vendored=vendored, compile_cache=compile_cache)
    tarball = make_tarball(src, root / "model.tar.gz", progress=False)
    return tarball.path.read_bytes(), (src / "manifest.json").read_bytes()
