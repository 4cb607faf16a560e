"""Rebuild stdlib_docs.txt.gz: English prose from the docstrings of the Python standard library.

Usage: python -m relaytrain.data.corpus.build_corpus [--max-bytes 2500000] [--out PATH]

Docstrings of pure-Python standard library modules and of their public classes, functions and methods
are read with `inspect.getdoc` (the Python source is under the PSF License, see README.md), split into
paragraphs, and filtered to prose: paragraphs that are mostly letters, contain no doctest or code
layout, and are not repeated. Modules are visited in sorted name order, so one Python version always
produces the same file. Paragraphs are written separated by blank lines, which `relaytrain
prepare-data` reads as document boundaries.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import io
import itertools
import pkgutil
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

# Importing these opens windows, browsers, starts GUIs or prints on import.
_SKIP_PREFIXES = (
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "test",
    "lib2to3",
    "ensurepip",
    "venv",
    "__main__",
    "__phello__",
    "_",
    "pydoc_data",
    "xxlimited",
    "msilib",
    "nturl2path",
    "winreg",
    "winsound",
    "encodings",
    "distutils",
)
_SKIP_SUFFIXES = ("__main__",)
_PROSE_CHAR = re.compile(r"[A-Za-z ,.;:'()\-]")
_CODE_HINT = re.compile(r">>>|\.\.\. |[{}\[\]=]{2,}|\\n")


def _stdlib_modules() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    names = set()
    for info in pkgutil.walk_packages([stdlib], onerror=lambda _name: None):
        skip = info.name.startswith(_SKIP_PREFIXES) or info.name.endswith(_SKIP_SUFFIXES)
        if not skip and ".test" not in info.name and info.name != "site-packages":
            names.add(info.name)
    return sorted(names)


def _docstrings(module) -> list[str]:
    docs = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isroutine(obj):
            docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and inspect.isroutine(member):
                    docs.append(inspect.getdoc(member) or "")
    return docs


def _prose_paragraphs(doc: str) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", doc):
        para = " ".join(line.strip() for line in para.strip().splitlines())
        if len(para) < 40 or _CODE_HINT.search(para) or not para[0].isalpha():
            continue
        if sum(bool(_PROSE_CHAR.match(c)) for c in para) / len(para) < 0.9:
            continue
        out.append(para)
    return out


def _topic_docs() -> list[str]:
    """The language reference sections that `help("topic")` shows (pydoc_data, also PSF-licensed)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _module_docs() -> Iterator[str]:
    sys.argv = sys.argv[:1]  # some modules parse the command line when imported
    for name in _stdlib_modules():
        try:
            with warnings.catch_warnings(), io.StringIO() as sink:
                warnings.simplefilter("ignore")
                stdout, sys.stdout = sys.stdout, sink
                try:
                    module = importlib.import_module(name)
                finally:
                    sys.stdout = stdout
        except BaseException:  # noqa: BLE001 - platform-specific modules fail to import in many ways
            continue
        yield from _docstrings(module)


def build(max_bytes: int) -> str:
    seen: set[str] = set()
    paragraphs: list[str] = []
    size = 0
    for doc in itertools.chain(_topic_docs(), _module_docs()):
        for para in _prose_paragraphs(doc):
            if para in seen:
                continue
            seen.add(para)
            paragraphs.append(para)
            size += len(para.encode()) + 2
            if size >= max_bytes:
                return "\n\n".join(paragraphs) + "\n"
    return "\n\n".join(paragraphs) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=2_500_000)
    parser.add_argument("--out", default=str(Path(__file__).with_name("stdlib_docs.txt.gz")))
    args = parser.parse_args()
    text = build(args.max_bytes)
    # No name and mtime=0 keep the .gz byte-identical across rebuilds of the same text.
    data = gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)
    Path(args.out).write_bytes(data)
    print(
        f"wrote {args.out}: {len(text.encode()):,} bytes of text, {text.count(chr(10) * 2) + 1:,} paragraphs"
    )


if __name__ == "__main__":
    main()
