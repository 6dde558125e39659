"""`python3 -m training {prompts,generate,train,estimate}`: see each command's --help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _add_fields(
    parser: argparse.ArgumentParser, cls, positional: dict[str, tuple], choices: dict[str, tuple]
) -> None:
    """One option per dataclass field (booleans as flags), named like the field; a field in
    `positional` is positional, with those choices; one in `choices` takes only those."""
    for f in dataclasses.fields(cls):
        if f.name in positional:
            parser.add_argument(f.name, choices=positional[f.name])
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.default is dataclasses.MISSING:
            parser.add_argument(flag, required=True, dest=f.name)
        elif isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", dest=f.name)
        else:
            parser.add_argument(
                flag,
                type=type(f.default),
                default=f.default,
                dest=f.name,
                choices=choices.get(f.name),
            )


def main(argv: list[str] | None = None) -> int:
    from training.build import ALGORITHMS
    from training.estimate import ANSWERS, EstimateConfig
    from training.generate import GenerateConfig
    from training.prompts import PromptsConfig
    from training.train import TrainConfig

    parser = argparse.ArgumentParser(prog="python3 -m training", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "prompts": (PromptsConfig, "ShareGPT prompts with the chat template -> a token file"),
        "generate": (GenerateConfig, "the target's responses to a prompt file"),
        "train": (TrainConfig, "train a draft (eagle3, eagle or mtp)"),
        "estimate": (EstimateConfig, "a draft's offline accept estimate on greedy data"),
    }
    for name, (cls, help_text) in commands.items():
        _add_fields(
            sub.add_parser(name, help=help_text),
            cls,
            positional={"algorithm": ALGORITHMS},
            choices={"answers": ANSWERS},
        )
    args = parser.parse_args(argv)
    cls = commands[args.command][0]
    cfg = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    if args.command == "prompts":
        from training.prompts import build_prompt_file

        print(json.dumps(build_prompt_file(cfg), indent=1))
    elif args.command == "generate":
        from training.generate import generate

        generate(cfg)
    elif args.command == "train":
        from training.train import Trainer

        print(json.dumps(Trainer(cfg).run()))
    else:
        from training.estimate import describe_estimate, estimate

        result = estimate(cfg)
        print(describe_estimate(result))
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
