"""Runs every Python example of docs/python.md (one per role), each in a
fresh namespace, so the page stays true."""

import os
import re

import pytest

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "python.md")


def examples():
    text = open(DOC, encoding="utf-8").read()
    found = []
    for section in text.split("\n## ")[1:]:
        title, _, body = section.partition("\n")
        found += [(title, code) for code in re.findall(r"```python\n(.*?)```", body, flags=re.S)]
    return found


def test_every_role_has_an_example():
    roles = [title for title, _ in examples()]
    assert roles == ["Donor (decode worker)", "Router", "Target (prefill worker)"]


@pytest.mark.parametrize("title, code", examples(), ids=lambda v: v.split()[0] if isinstance(v, str) else v)
def test_example_runs(title, code):
    exec(compile(code, f"docs/python.md: {title}", "exec"), {})
