"""`ridge plan`, `ridge plan spec`, `ridge plot roofline` and `ridge doctor`."""

from __future__ import annotations

import argparse
import dataclasses
import json

from ridge.models.presets import model_presets
from ridge.plan.specs import BYTES_PER_VALUE, KV_DTYPES, hardware_table, link_table


def _workload_args(p: argparse.ArgumentParser) -> None:
    """The model / hardware / workload flags; --model and --hardware are checked by the command that needs
    them (plan spec and plot roofline have defaults or need less)."""
    p.add_argument("--model",
                   help="a preset (" + ", ".join(model_presets()) + "), a config.json (or its directory) or a "
                        "GGUF file")
    p.add_argument("--hardware",
                   help="one of " + ", ".join(hardware_table()) + ", or this-machine (measured now)")
    p.add_argument("--context", type=int, default=4096,
                   help="tokens each sequence holds while decoding (default %(default)s)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens for prefill / TTFT (default: --context)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default %(default)s)")
    dtypes = list(BYTES_PER_VALUE)
    p.add_argument("--dtype", default="bf16", choices=dtypes, help="weight dtype (default %(default)s)")
    p.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES,
                   help="KV-cache dtype: a plain one, or ridge's quantized formats (codes and scales; int2 keeps "
                        "each sequence's last block in 16 bits) (default %(default)s)")
    p.add_argument("--gpus", type=int, default=1, help="devices, tensor-parallel (default %(default)s)")
    p.add_argument("--link", default=None,
                   help="the interconnect between --gpus, one of " + ", ".join(link_table())
                        + " (default: the hardware's own, hardware.toml)")
    p.add_argument("--price-per-hour", type=float, default=None, help="$ per hour for all --gpus (cost per token)")
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="fraction of device memory for weights + KV (default %(default)s)")
    p.add_argument("--shared-prefix", type=float, default=0.0,
                   help="fraction of prompt tokens shared across requests, for prefix caching (default 0)")
    p.add_argument("--tpot-ms", type=float, default=None,
                   help="time-per-output-token target: sizes chunked prefill so a prompt never stalls decode longer")
    p.add_argument("--throughput", type=float, default=None,
                   help="tok/s to price with --price-per-hour (default: the plan's decode ceiling)")
    p.add_argument("--set", dest="model_set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a model field, e.g. --set num_kv_heads=4 (repeatable)")
    p.add_argument("--hw-set", dest="hardware_set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a hardware field, e.g. --hw-set bandwidth_gb_s=2000 or tflops.bf16=500 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a roofline with the workload's points")


def _resolve(args: argparse.Namespace):
    from ridge.models.presets import resolve_model
    from ridge.plan.specs import Workload, override, resolve_hardware

    model = override(resolve_model(args.model), args.model_set)
    hw = override(resolve_hardware(args.hardware), args.hardware_set)
    workload = Workload(context=args.context, prompt=args.prompt, batch=args.batch, dtype=args.dtype,
                        kv_dtype=args.kv_dtype, gpus=args.gpus, link=args.link, price_per_hour=args.price_per_hour,
                        memory_utilization=args.memory_utilization, shared_prefix=args.shared_prefix,
                        tpot_target=args.tpot_ms / 1e3 if args.tpot_ms is not None else None,
                        throughput=args.throughput).validate()
    return model, hw, workload


def _plan_points(plan):
    """The plan's prefill and decode points, and decode over batch sizes, at their bound's FLOP/s."""
    from ridge.plan.arithmetic import step_bound
    from ridge.plan.plot import RooflinePoint

    w = plan.workload
    points = [RooflinePoint(f"prefill, {w.prompt_tokens:,}-token prompt ({plan.prefill.wall})",
                            plan.prefill.intensity, plan.prefill.flops / plan.prefill.seconds),
              RooflinePoint(f"decode, batch {w.batch} ({plan.decode.wall})", plan.decode.intensity,
                            plan.decode.flops / plan.decode.seconds)]
    curve, batch = [], 1
    while batch <= max(plan.memory.max_batch, 1) and batch <= 4096:
        step = step_bound(plan.model, plan.hardware, w, batch)
        curve.append(RooflinePoint(f"B={batch}", step.intensity, step.flops / step.seconds))
        batch *= 2
    return points, curve


def _encoder_points(plan):
    """An encoder plan's pass, and passes over batch sizes, at their bound's FLOP/s."""
    from ridge.plan.encoder import pass_bound
    from ridge.plan.plot import RooflinePoint

    w, tokens = plan.workload, plan.prompt_tokens
    points = [RooflinePoint(f"a pass of {w.batch} x {tokens:,}-token prompts ({plan.embed.wall})",
                            plan.embed.intensity, plan.embed.flops / plan.embed.seconds)]
    bounds = [(2**i, pass_bound(plan.model, plan.hardware, w, tokens, 2**i)) for i in range(8)]
    return points, [RooflinePoint(f"B={b}", bound.intensity, bound.flops / bound.seconds) for b, bound in bounds]


def cmd_plan(args: argparse.Namespace) -> int:
    from ridge.models.registry import is_encoder
    from ridge.plan.arithmetic import compute_dtype
    from ridge.plan.encoder import build_encoder_plan, render_encoder
    from ridge.plan.plot import plot_roofline
    from ridge.plan.report import build_plan, render

    model, hw, workload = _resolve(args)
    if is_encoder(model.architecture):  # no decode, no KV: a pass over a batch of prompts (plan/encoder.py)
        plan = build_encoder_plan(model, hw, workload)
        text, points_of = render_encoder, _encoder_points
        curve_label = f"a pass of {plan.prompt_tokens:,}-token prompts, by batch size"
        title = f"{model.name} on {hw.name}: {workload.dtype} weights"
    else:
        plan = build_plan(model, hw, workload)
        text, points_of = render, _plan_points
        curve_label = f"decode at {workload.context:,} tokens of context, by batch size"
        title = f"{model.name} on {hw.name}: {workload.dtype} weights, {workload.kv_dtype} KV"
    if args.plot:
        points, curve = points_of(plan)
        plot_roofline(hw, compute_dtype(workload.dtype), args.plot, points, curve, curve_label, title)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(text(plan))
        if args.plot:
            print(f"\nroofline plot: {args.plot}")
    return 0


def cmd_plan_spec(args: argparse.Namespace) -> int:
    from ridge.plan.arithmetic import expected_tokens_per_pass
    from ridge.plan.speculation import speculation_table

    model, hw, workload = _resolve(args)
    expected = expected_tokens_per_pass(args.accept, args.k)
    rows = speculation_table(model, hw, args.accept, args.k, args.draft_cost, workload)
    if args.json:
        print(json.dumps({"accept": args.accept, "k": args.k, "draft_cost": args.draft_cost,
                          "expected_tokens_per_pass": expected, "model": model.name, "hardware": hw.name,
                          "rows": [dataclasses.asdict(r) for r in rows]}, indent=2))
        return 0
    print(f"speculative decoding, a = {args.accept}, k = {args.k}, drafter at {args.draft_cost:.0%} of a target step")
    print(f"  expected tokens per target pass: (1 - a^(k+1)) / (1 - a) = {expected:.2f}")
    print(f"  {model.name} on {hw.name}, context {workload.context:,}:")
    print(f"  {'batch':>6} {'step':>10} {'verify':>10} {'speedup':>8}  verify pass")
    for r in rows:
        print(f"  {r.batch:>6} {r.step_seconds * 1e3:>8.2f}ms {r.verify_seconds * 1e3:>8.2f}ms {r.speedup:>7.2f}x"
              f"  {r.wall}-bound{'' if r.fits else ' (KV does not fit)'}")
    if rows[-1].speedup < 1:
        print(f"  from batch {rows[-1].batch} the verification pass is compute-bound and speculation slows decoding")
    return 0


def cmd_plot_roofline(args: argparse.Namespace) -> int:
    from ridge.plan.plot import plot_roofline
    from ridge.plan.report import build_plan
    from ridge.plan.specs import override, resolve_hardware

    if args.model:
        model, hw, workload = _resolve(args)
        from ridge.plan.arithmetic import compute_dtype

        plan = build_plan(model, hw, workload)
        points, curve = _plan_points(plan)
        plot_roofline(hw, compute_dtype(workload.dtype), args.out, points, curve,
                      f"decode at {workload.context:,} tokens of context, by batch size",
                      f"{model.name} on {hw.name}")
    else:
        hw = override(resolve_hardware(args.hardware), args.hardware_set)
        plot_roofline(hw, args.dtype, args.out)
    print(json.dumps({"plot": args.out}) if args.json else f"roofline plot: {args.out}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from ridge import LLM
    from ridge.flags import engine_kwargs
    from ridge.plan.doctor import render, run_doctor
    from ridge.plan.plot import RooflinePoint, plot_roofline

    llm = LLM(args.model, **engine_kwargs(args))
    report = run_doctor(args.model, llm.engine.loaded.spec, llm, output_len=args.output_len, batch=args.batch)
    if args.plot:
        points = [RooflinePoint(f"{p.name}: {p.seconds * 1e3:.1f} ms ({p.wall})", p.intensity, p.flops / p.seconds,
                                measured=True) for p in report.phases]
        plot_roofline(report.hardware, report.compute_dtype, args.plot, points,
                      title=f"ridge doctor: {args.model} on this machine (measured)")
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(render(report))
        if args.plot:
            print(f"  roofline plot: {args.plot}")
    return 0


def add_plan_parsers(sub, add_engine_args) -> None:
    plan = sub.add_parser(
        "plan", help="size a deployment: memory, FLOPs, bytes, the binding wall, recommendations",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Do the arithmetic of serving a model on some hardware: parameters, weight and KV bytes, whether "
                    "it fits and the largest batch that does, prefill FLOPs (with the O(context^2) attention term) "
                    "and decode bytes per token, each phase's arithmetic intensity against the hardware's ridge "
                    "point, time bounds (TTFT, per-token latency, tok/s ceiling), cost per million tokens, and the "
                    "techniques that relax the binding wall, ranked.\n\n"
                    "  ridge plan --model qwen3-8b --hardware h100-sxm --context 40000\n"
                    "  ridge plan --model llama-3-70b --hardware h100-sxm --dtype int8 --gpus 2 --batch 32\n"
                    "  ridge plan spec --accept 0.8 --k 4 --draft-cost 0.05 --model qwen3-8b --hardware h100-sxm")
    _workload_args(plan)
    plan.set_defaults(func=lambda args: _require_and_run(plan, args, cmd_plan))
    plan_sub = plan.add_subparsers(dest="plan_command")
    s = plan_sub.add_parser("spec", help="speculative decoding: tokens per pass and speedup by batch size",
                            description="Expected tokens per target pass (1 - a^(k+1)) / (1 - a) for acceptance a "
                                        "and k drafted tokens, and the net speedup with a drafter costing c of a "
                                        "target step, for batch sizes up to where verification turns compute-bound.")
    s.add_argument("--accept", type=float, required=True, help="per-token acceptance probability a, in [0, 1)")
    s.add_argument("--k", type=int, default=4, help="tokens drafted per pass (default %(default)s)")
    s.add_argument("--draft-cost", type=float, default=0.05,
                   help="drafter step time / target step time (default %(default)s)")
    _workload_args(s)  # model and hardware default to qwen3-8b on h100-sxm
    s.set_defaults(model="qwen3-8b", hardware="h100-sxm", func=cmd_plan_spec)

    plot = sub.add_parser("plot", help="pictures: the roofline of a machine, with a workload on it")
    plot_sub = plot.add_subparsers(dest="plot_command", required=True)
    r = plot_sub.add_parser("roofline", help="write a roofline PNG (a workload's points with --model)")
    _workload_args(r)
    r.add_argument("--out", default="roofline.png", help="PNG to write (default %(default)s)")
    r.set_defaults(func=lambda args: _require_and_run(r, args, cmd_plot_roofline, need_model=False))

    d = sub.add_parser("doctor", help="measure this machine, run ridge, report fractions of the roofline",
                       description="Measure this machine's read bandwidth and matmul FLOP/s, run ridge on a short "
                                   "latency workload (one request) and a short throughput one (--batch requests), "
                                   "and report each phase's achieved GB/s and FLOP/s as fractions of the measured "
                                   "ceilings, the binding wall, the time lost to overhead, and what to do about it.")
    d.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default %(default)s)")
    d.add_argument("--batch", type=int, default=16, help="requests in the throughput workload (default %(default)s)")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument("--plot", default=None, metavar="PNG", help="write the measured points on the roofline")
    add_engine_args(d)
    d.set_defaults(func=cmd_doctor)


def _require_and_run(parser: argparse.ArgumentParser, args: argparse.Namespace, cmd, need_model: bool = True) -> int:
    missing = [f"--{name}" for name in ("model", "hardware") if not getattr(args, name)
               and (need_model or name == "hardware")]
    if missing:
        parser.error(f"{' and '.join(missing)} required")
    return cmd(args)
