"""Command line: ``python -m autopar demo``, ``python -m autopar plan``, ``python -m autopar
diff``, ``python -m autopar export`` and ``python -m autopar calibrate``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser, every subcommand with its options (the docs check their command
    lines against it)."""
    # the `autopar` console script, or `python -m autopar`
    called = "autopar" if Path(sys.argv[0]).name == "autopar" else "python -m autopar"
    parser = argparse.ArgumentParser(prog=called)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a char-level GPT on Python stdlib source")
    demo.add_argument("--steps", type=int, default=400)
    demo.add_argument("--batch-size", type=int, default=32)
    demo.add_argument("--dump-dir", default="dumps/demo")
    demo.add_argument("--strategy", default=None,
                      help="strategy YAML (default: configs/dp_tp.yaml, 4 ranks)")
    demo.add_argument("--resume", action="store_true",
                      help="continue from the newest checkpoint in <dump-dir>/checkpoints "
                           "(under any strategy; pass a larger --steps)")
    plan = sub.add_parser(
        "plan", help="plan a training script for its whole mesh in this one process, write "
                     "the per-pass dumps and explain placements (no launcher needed)")
    plan.add_argument("script", help="a training script that builds an autopar.Engine; "
                                     "its own arguments go after '--'")
    plan.add_argument("--strategy", help="a strategy YAML that replaces the script's own, "
                                         "or a packaged config's name (dp_tp)")
    plan.add_argument("--dump-dir", default="dumps/plan")
    plan.add_argument("--ranks", type=_ranks, default="classes", metavar="RANKS",
                      help="whose lowered programs to dump: classes (one rank per class of "
                           "identical ranks; the default), all, or a list: 0,517")
    plan.add_argument("--locate-divergence", action="store_true",
                      help="run the first training step on the simulator next to one device "
                           "and report the first op that differs")
    plan.add_argument("--explain", action="append", default=[], metavar="VALUE",
                      help="why VALUE has its placement: %%12, loss, grad[fc1.weight], "
                           "fc1.weight (repeatable); the answer in at most 10 lines")
    plan.add_argument("--depth", type=_depth, default=0, metavar="N",
                      help="--explain: also the chain of reasons behind each answer, value "
                           "by value, N levels deep")
    plan.add_argument("--auto", action="store_true",
                      help="let the planner choose the strategy (the script's mesh, degrees, "
                           "ZeRO and recompute are dropped; --strategy's are kept as "
                           "constraints): prints the candidates and the chosen strategy")
    plan.add_argument("--devices", type=int, help="--auto: how many devices to plan for")
    plan.add_argument("--memory-limit-gb", type=float,
                      help="--auto: peak memory per device the plan must fit")
    plan.add_argument("--axes", help="--auto: the axes to consider, comma separated "
                                     "(default dp,tp,pp)")
    plan.add_argument("--top", type=int, help="--auto: candidates shown (default 5)")
    plan.add_argument("--time-budget-s", type=float,
                      help="--auto: stop starting candidates after this long (default 60)")
    plan.add_argument("--write-strategy", metavar="FILE",
                      help="write the planned strategy's YAML to FILE (under --auto or an "
                           "auto: section, the one the planner chose)")
    diff = sub.add_parser(
        "diff", help="what changed between two plans: compare two dump directories "
                     "(--dump-dir / debug.dump_dir) pass by pass, passes matched by name")
    diff.add_argument("dump_a", metavar="DUMP_A", help="the first plan's dump directory")
    diff.add_argument("dump_b", metavar="DUMP_B", help="the second plan's dump directory")
    diff.add_argument("--rank", type=int, action="append", metavar="R",
                      help="compare only rank R (repeatable; default: every rank)")
    diff.add_argument("--max-lines", type=int, default=60, metavar="N",
                      help="diff lines shown per changed pass (default 60)")
    diff.add_argument("--context", type=int, default=2, metavar="N",
                      help="unchanged lines around each change (default 2)")
    diff.add_argument("--summary", action="store_true",
                      help="only the one-line summary per pass, no diffs")
    diff.add_argument("--exit-code", action="store_true",
                      help="exit 1 when the plans differ, 0 when they are the same")
    export = sub.add_parser(
        "export", help="consolidate the model of a checkpoint (Engine.save) into one "
                       "safetensors file")
    export.add_argument("checkpoint", help="a checkpoint directory written by Engine.save")
    export.add_argument("out", help="the .safetensors file, or a directory for "
                                    "OUT/model.safetensors")
    calibrate = sub.add_parser(
        "calibrate", help="measure this machine's compute and collective costs with "
                          "the processes training runs (the profile the cost model reads)")
    calibrate.add_argument("--processes", type=int, default=None,
                           help="concurrent processes, as many as training launches "
                                "(default: WORLD_SIZE under torchrun, else one per GPU on "
                                "CUDA, 4 on the CPU)")
    calibrate.add_argument("--out", default=None,
                           help="profile file (default: $AUTOPAR_PROFILE, else "
                                "~/.cache/autopar/profile.json)")
    calibrate.add_argument("--quick", action="store_true",
                           help="fewer sizes and repeats: seconds, not a minute")
    calibrate.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                           help="what to measure, as the strategy's device: says (default: "
                                "$AUTOPAR_CALIBRATE_DEVICE, else auto: CUDA where present)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # plan's own options anywhere; the script's arguments after "--"
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.command == "demo":
        run_demo(args, argv)
    elif args.command == "plan":
        from .engine.offline import plan_script
        print(plan_script(args.script, script_args, args.strategy, args.dump_dir,
                          args.explain, args.locate_divergence, _auto_section(parser, args),
                          args.write_strategy, args.depth, args.ranks))
    elif args.command == "diff":
        run_diff(parser, args)
    elif args.command == "export":
        from .checkpoint import consolidate_model
        print(consolidate_model(args.checkpoint, args.out))
    elif args.command == "calibrate":
        run_calibrate(args)


def _ranks(text: str) -> object:
    """``plan --ranks``: ``classes``, ``all`` or ranks separated by commas."""
    if text in ("classes", "all"):
        return text
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give classes, all, or ranks such as 0,517") from None
    if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct ranks from 0, such as 0,517")
    return ranks


def _auto_section(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict | None:
    """``plan --auto``'s options as an ``auto`` section (checked before the script runs)."""
    options = {"devices": args.devices, "memory_limit_gb": args.memory_limit_gb,
               "top": args.top, "time_budget_s": args.time_budget_s,
               "axes": args.axes.split(",") if args.axes else None}
    if not args.auto:
        given = [f"--{k.replace('_', '-')}" for k, v in options.items() if v is not None]
        if given:
            parser.error(f"{', '.join(given)} only with --auto")
        return None
    if args.devices is None:
        parser.error("plan --auto needs --devices N (how many devices to plan for)")
    from .strategy.sections import AutoConfig
    auto = {k: v for k, v in options.items() if v is not None}
    try:
        AutoConfig.model_validate(auto)
    except ValueError as err:
        parser.error(f"--auto: {err}")
    return auto


def _depth(text: str) -> int:
    """``--depth``: a whole number of levels, 0 or more."""
    depth = int(text)
    if depth < 0:
        raise argparse.ArgumentTypeError(f"{depth} levels: give 0 or more")
    return depth


def run_diff(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Print what changed between two plans' dumps; a missing or foreign directory is a
    usage error naming it."""
    from .pass_infra.dump_diff import format_dump_diff
    if args.max_lines < 0 or args.context < 0:
        parser.error("diff: --max-lines and --context take 0 or more")
    try:
        text, differs = format_dump_diff(args.dump_a, args.dump_b, args.rank, args.max_lines,
                                         args.context, args.summary)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    print(text, end="")
    if args.exit_code and differs:
        sys.exit(1)


def run_demo(args: argparse.Namespace, argv: list[str]) -> None:
    """Under torchrun (or for a one-rank strategy): one rank of the demo. Otherwise launch
    the strategy's ranks through torchrun."""
    import os

    from . import Strategy
    from .demo import DEFAULT_STRATEGY, launch
    from .demo import main as demo_main
    strategy = args.strategy or str(DEFAULT_STRATEGY)
    ranks = Strategy.from_yaml(strategy).world_size
    if "WORLD_SIZE" not in os.environ and ranks > 1:
        sys.exit(launch(argv[1:], ranks))
    demo_main(args.steps, args.batch_size, args.dump_dir, strategy, resume=args.resume)


def run_calibrate(args: argparse.Namespace) -> None:
    """Under torchrun (or for one process): measure on this rank. Otherwise launch the
    processes through torchrun."""
    import os

    from .calibrate import default_processes, launch, run
    if "WORLD_SIZE" not in os.environ:
        args.processes = args.processes or default_processes(args.device)
        if args.processes > 1:
            sys.exit(launch([f"--processes={args.processes}",
                             *([f"--out={args.out}"] if args.out else []),
                             *([f"--device={args.device}"] if args.device else []),
                             *(["--quick"] if args.quick else [])], args.processes))
    run(args.processes, args.out, args.quick, args.device)


if __name__ == "__main__":
    main()
