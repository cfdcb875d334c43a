"""How long `verify_package` takes on a package of S1-mini's size (start-up cost of the check).

Writes random files of the real checkpoint's sizes and a manifest for them, then times
verify_package in fresh processes (the per-process cache would make a repeat free), with
the files in the page cache and, where allowed, after dropping it.

    python benchmarks/package_verify_time.py /tmp/pkg [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SIZES = {"model.pth": 1_724_000_000, "codec.pth": 1_870_000_000, "config.json": 1_000, "tokenizer.tiktoken": 2_500_000,
         "special_tokens.json": 100_000, **{f"code/fish_sm/m{i}.py": 20_000 for i in range(50)}}


def write_package(root: Path) -> None:
    from fish_sm.package.verify import file_sha256

    files = {}
    for name, size in SIZES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.stat().st_size != size:
            with open(path, "wb") as f:
                for start in range(0, size, 1 << 26):
                    f.write(os.urandom(min(1 << 26, size - start)))
        files[name] = {"size": size, "sha256": file_sha256(path)}
    (root / "manifest.json").write_text(json.dumps({"format": 1, "files": files}, indent=2, sort_keys=True))


def time_once(root: Path) -> float:
    code = ("import time; from fish_sm.package.verify import verify_package; t=time.perf_counter(); "
            f"assert verify_package({str(root)!r}); print(time.perf_counter()-t)")
    return float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="where the package of random files is written (reused if there)")
    parser.add_argument("--repeats", type=int, default=3, help="timed verifications with the page cache warm")
    args = parser.parse_args()
    t0 = time.perf_counter()
    write_package(args.root)
    print(f"package written ({sum(SIZES.values()) / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    print("page cache warm:", ", ".join(f"{time_once(args.root):.2f} s" for _ in range(args.repeats)))
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        print(f"page cache dropped: {time_once(args.root):.2f} s")
    except OSError as exc:
        print(f"page cache not dropped ({exc.strerror})")


if __name__ == "__main__":
    main()
