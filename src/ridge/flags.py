"""The command line's engine and sampling flags, and the EngineConfig / SamplingParams they build: shared by
`ridge`'s commands, the benchmarks and the planner's doctor, below all of them (it imports none)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ridge import hub
from ridge.config import EngineConfig
from ridge.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--model and one flag per EngineConfig knob: its name, default, choices and help come from the field."""
    groups = {"engine": p.add_argument_group("engine")}
    groups["engine"].add_argument(
        "--model", "-m", default=hub.DEFAULT_MODEL,
        help=f"alias ({', '.join(hub.ALIASES)}), a .gguf file or an HF directory (default %(default)s)")
    for f in dataclasses.fields(EngineConfig):
        if "help" not in f.metadata:
            continue
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], p.add_argument_group(meta["group"]))
        name = meta["flag"] or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif f.type.startswith("tuple"):  # a list of strings, as vLLM's --lora-modules takes them
            kwargs.update(nargs="+", type=str)
        else:
            kwargs["type"] = int if f.type.startswith("int") and f.type != "int | str" else str
            if meta["choices"] is not None:
                kwargs["choices"] = list(meta["choices"])
        group.add_argument(name, *meta["aliases"], **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig arguments of add_engine_args' flags (all but --model)."""
    return {f.name: tuple(value) if isinstance(value := getattr(args, f.name), list) else value
            for f in dataclasses.fields(EngineConfig) if "help" in f.metadata}


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling (vLLM's names and meanings)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens at most (default %(default)s)")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS/stop before this many tokens")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same tokens")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="top-n logprobs per generated token")
    g.add_argument("-n", type=int, default=1, help="samples per prompt")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, logprobs=args.logprobs,
    )
