"""`asyncrl replay prune` (being built)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    raise NotImplementedError("asyncrl replay prune is not built yet")
