"""Convert a Llama GGUF file into a Hugging Face model directory (float32 safetensors).

  python tools/convert_gguf.py                      # the default model, into the Aerie cache
  python tools/convert_gguf.py model.gguf out_dir   # any Llama-architecture GGUF

Quantized tensors (Q4_1, Q6_K, ...) are dequantized; q/k rows get llama.cpp's rotary
permutation undone; the tokenizer and chat template come from the GGUF metadata.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aerie.default_model import convert_gguf_to_hf, ensure_default_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="?", help="GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("output", nargs="?", help="output directory (must not exist)")
    parser.add_argument("--cache-dir", help="Aerie cache root for the default model")
    args = parser.parse_args(argv)
    if args.gguf is None:
        print(ensure_default_model(args.cache_dir))
        return
    if args.output is None:
        parser.error("give an output directory after the GGUF file")
    if os.path.exists(args.output):
        parser.error(f"{args.output} exists; choose a new directory")
    print(convert_gguf_to_hf(args.gguf, args.output))


if __name__ == "__main__":
    main()
