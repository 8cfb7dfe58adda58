"""The package's layout: the library imports only Keras and a backend, the searches know
nothing of the model, and the special ids and decoding defaults are written once."""

import pathlib
import re
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).parent.parent / "keras_transformer"


def test_the_library_imports_no_tool_and_changes_no_global_state():
    code = """
import os, sys
import keras  # Keras itself may import matplotlib when it is installed: not ours to count
before, env = set(sys.modules), dict(os.environ)
import keras_transformer
import keras_transformer.layers, keras_transformer.models, keras_transformer.decoding
new = set(sys.modules) - before
print(sorted({m.split('.')[0] for m in new} & {'tensorflow_text', 'matplotlib', 'sacrebleu', 'tokenizers', 'num2words'}))
print(sorted(m for m in new if m.startswith(('keras_transformer.tools', 'claims'))))
print(dict(os.environ) == env)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:3] == ["[]", "[]", "True"], result.stdout


def test_the_searches_reach_into_no_model_and_ids_are_written_once():
    search = (PACKAGE / "decoding.py").read_text()
    assert not re.search(r"\bmodel\.\w|\.decoder\b|target_embedding|\.project\(", search)
    # The default special ids and the paper's decoding settings: one assignment each.
    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    for pattern in (r"\bPAD_ID\s*=|PAD_ID, UNK_ID, START_ID, END_ID\s*=", r"\bBEAM_SIZE\s*=", r"\bLENGTH_PENALTY\s*=",
                    r"\bMAX_EXTRA_LENGTH\s*="):
        defined = [p.name for p, text in sources.items() if re.search(pattern, text)]
        assert defined == ["defaults.py"], (pattern, defined)
    # No literal default of an id or a decoding setting in a signature outside that file.
    literal = re.compile(r"\b(pad_id|start_id|end_id|beam_size|length_penalty|max_extra_length)(: \w+)? = \d")
    offenders = [f"{p.relative_to(PACKAGE)}:{m.group(0)}" for p, text in sources.items() for m in literal.finditer(text)]
    assert offenders == [], offenders


def test_an_editable_install_builds_without_warnings(tmp_path):
    # The PEP 660 hook that `pip install -e .` calls, with this environment's setuptools;
    # pip shows the warnings it emits (e.g. the one about folders that shadow the package).
    code = """
import sys, warnings
from setuptools import build_meta
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    name = build_meta.build_editable(sys.argv[1])
print(name)
print([f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught])
"""
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    name, warnings = result.stdout.strip().splitlines()[-2:]
    assert name.startswith("keras_transformer-") and name.endswith(".whl")
    assert warnings == "[]", warnings


def test_modules_and_tool_functions_stay_short():
    """No module of the package over 400 lines; no function of the tools over 60 (a longer
    one is doing two jobs: split it)."""
    import ast

    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 400:
            long_modules.append(f"{path.relative_to(PACKAGE)}: {text.count(chr(10))} lines")
        if "tools" in path.relative_to(PACKAGE).parts:
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        long_functions.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert long_modules == [] and long_functions == [], long_modules + long_functions
