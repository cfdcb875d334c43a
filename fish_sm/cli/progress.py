"""Progress bars on stderr for the long steps (hashing, archiving, uploading, downloading).

The library reports progress through callbacks and never prints; these are the callbacks
the commands pass.
"""

from __future__ import annotations

import sys

import click


class ByteProgress:
    """A bar for (done, total) byte counts, from the first call on; the with block finishes it."""

    def __init__(self, label: str, enabled: bool = True):
        self.label, self.enabled = label, enabled
        self._bar = None
        self._done = 0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = click.progressbar(length=max(total, 1), label=self.label, file=sys.stderr,
                                          show_pos=False, show_percent=True, show_eta=True)
            self._bar.__enter__()
        self._bar.update(done - self._done)
        self._done = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
        self._bar = None

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FileProgress:
    """A progress bar per large file for build_package_dir's (what, done, total) callbacks.

    Small files (the code, voices) hash in a blink, so only files of min_bytes or more get a
    bar: a line per file of a copied source tree would bury the two that take minutes.
    """

    def __init__(self, min_bytes: int = 32 * 1024 * 1024, enabled: bool = True):
        self.min_bytes, self.enabled = min_bytes, enabled
        self._bar = self._what = None
        self._done = 0

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled or total < self.min_bytes:
            return
        if what != self._what:
            self.close()
            self._bar = click.progressbar(length=total, label=what, file=sys.stderr, show_pos=False)
            self._bar.__enter__()
            self._what, self._done = what, 0
        self._bar.update(done - self._done)
        self._done = done
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
        self._bar = self._what = None

    def __enter__(self) -> "FileProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
