"""Command line: ``python -m autopar demo``."""
from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m autopar")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a char-level GPT on Python stdlib source")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--dump-dir", default="dumps/demo")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as run_demo
        run_demo(args.steps, args.batch_size, args.dump_dir)


if __name__ == "__main__":
    main()
