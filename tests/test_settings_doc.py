"""docs/settings.md names every `FISH_SM_*` setting that `Settings` reads, and no other."""

import dataclasses
import re
from pathlib import Path

from fish_sm.settings import PREFIX, Settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_the_settings_page_matches_settings():
    documented = set(re.findall(r"FISH_SM_[A-Z0-9_]+", DOC.read_text()))
    fields = {PREFIX + f.name.upper() for f in dataclasses.fields(Settings)}
    assert sorted(fields - documented) == [], "settings not in docs/settings.md"
    assert sorted(documented - fields) == [], "docs/settings.md names settings that do not exist"
