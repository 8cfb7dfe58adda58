"""The Python code blocks of the README and of every docs page run.

A page's blocks run in order in one namespace, in a temporary directory, as a reader
would paste them. A page runs in the PyTorch suite: its code is the public API, whose
results every backend's suite checks, and eager PyTorch runs a page's small models
quickest. A page with a block preceded by `<!-- test: only <backend> -->` runs in every
suite, and that block on that backend only; one preceded by `<!-- test: skip (reason) -->` needs what a test cannot
have (a server, 8 devices) and is shown only. Lines `--8<-- "path"` (files included into the
page) are replaced by the file, run as a module (definitions only, no `__main__`).
The strict docs build (`make docs`) checks links, navigation and API names.
"""

import os
import pathlib
import re

import pytest
import yaml

from tests.conftest import BACKEND, only_on

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if "```python" in p.read_text(encoding="utf-8")]  # pages with code
BLOCK = re.compile(r"(?:<!-- test: (?:only (?P<only>\w+)|(?P<skip>skip) \(.+?\)) -->\n)?```python\n(?P<code>.*?)```",
                   re.S)
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', re.M)


def blocks(page):
    """`(only, code, included file)` per block; `only` is a backend, "skip" or None."""
    for match in BLOCK.finditer(page.read_text(encoding="utf-8")):
        included = SNIPPET.search(match["code"])
        code = SNIPPET.sub(lambda m: (ROOT / m["path"]).read_text(encoding="utf-8"), match["code"])
        yield match["only"] or match["skip"], code, included and str(ROOT / included["path"])


def _suites(page):
    """Every suite for a page with a block of one backend's, the PyTorch suite for the others."""
    if any(only not in (None, "skip") for only, _, _ in blocks(page)):
        return ()
    return only_on("torch", "the page's code is the public API, checked on every backend by the other tests")


@pytest.mark.parametrize("page", [pytest.param(p, id=p.relative_to(ROOT).as_posix(), marks=_suites(p)) for p in PAGES])
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # a block may set KERAS_BACKEND for readers
    namespace = {"__name__": "docs_snippet"}
    ran = 0
    for only, code, included in blocks(page):
        if only is not None and only != BACKEND:
            continue
        if included:
            namespace["__file__"] = included
        exec(compile(code, f"{page.name} block {ran + 1}", "exec"), namespace)  # noqa: S102
        ran += 1
    if ran == 0:
        pytest.skip(f"{page.name}: its Python blocks are marked for other backends")


def nav_pages(entries):
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from nav_pages(value)
        else:
            yield value


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = set(nav_pages(config["nav"]))
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")
               if "claims/" not in p.relative_to(ROOT / "docs").as_posix()}
    assert in_nav == on_disk
    for name in ("getting-started.md", "faq.md", "faq.zh.md", "claims.md", "guides/distributed.md",
                 "concepts/beam-search.md", "api/layers.md"):
        assert name in in_nav


def test_every_public_name_has_an_api_entry():
    import keras_transformer as kt

    api = "".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    for module in (kt.layers, kt.models, kt.distribution):
        for name in module.__all__:
            assert re.search(rf"(::: keras_transformer\.\S*\.{name}\b|- {name}\n)", api), name
    for name in ("scaled_dot_product_attention", "windowed_attention", "beam_search", "greedy_search",
                 "export_translator", "Tokenizer", "LabelSmoothedCrossEntropy", "TransformerSchedule"):
        assert name in api, name
