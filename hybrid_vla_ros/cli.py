"""``hybrid-vla`` command line: ``init-model`` and ``replay``.

Run as ``hybrid-vla ...`` (installed) or ``python -m hybrid_vla_ros.cli ...`` (from the source tree).
Subcommands import torch / rclpy only when they run, so ``--help`` is instant.
"""
from __future__ import annotations

import argparse
import sys


def _init_model(args: argparse.Namespace) -> int:
    from .core.checkpoint import init_model, model_id

    try:
        cfg = init_model(args.preset, args.path, seed=args.seed)
    except (FileExistsError, ValueError) as e:
        print(f"hybrid-vla init-model: {e}", file=sys.stderr)
        return 1
    print(f"wrote a RANDOM-INIT '{args.preset}' checkpoint to {args.path} (model id {model_id(args.path) & (2**64 - 1):016x}): "
          f"{cfg.n_cameras} cameras at {cfg.image_size}px, {cfg.num_layers} decoder blocks, "
          f"hidden states {cfg.prefix_state_shape}. Its trajectories exercise the pipeline; they are not driving advice.")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .replay import run_replay

    return run_replay(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-vla", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-model", help="write a random-init checkpoint of a preset")
    p.add_argument("--preset", default="tiny", help="preset name (tiny)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("path", help="checkpoint directory to create")
    p.set_defaults(func=_init_model)

    from .replay import add_arguments

    r = sub.add_parser("replay", help="run both nodes on a bag and report (the main job)")
    add_arguments(r)
    r.set_defaults(func=_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
