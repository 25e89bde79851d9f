"""``python -m rllib_exgrpo.models.shipped_cli check | rebuild | record FOLDER``: the shipped
tiny model's command line (see ``shipped``). A module of its own because it imports ``tiny``,
which imports ``shipped``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

from rllib_exgrpo.models.shipped import (
    REBUILD_ENV_VAR,
    REPRODUCIBLE_FILES,
    SHIPPED,
    file_digests,
    sha256_of,
    shipped_folder,
    verify,
)
from rllib_exgrpo.models.recipe import recipe_key, tiny_recipe


def _default_name() -> str:

    return f"tiny-{recipe_key(tiny_recipe())}"


def _check(args) -> int:
    name = _default_name()
    folder = shipped_folder(name)
    if folder is None:
        print(f"no shipped folder for the default recipe {name} (shipped: {sorted(SHIPPED)})")
        return 1
    verify(folder, name)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(
        f"{name}: {len(SHIPPED[name])} files, {size / 1e6:.2f} MB, sha256 as recorded "
        f"(model.safetensors {SHIPPED[name]['model.safetensors']})"
    )
    return 0


def _rebuild(args) -> int:
    # looked up when called: tests replace it
    from rllib_exgrpo.models.tiny import build_tiny_model, read_warm_start

    name = _default_name()
    cache = args.cache or tempfile.mkdtemp(prefix="rllib-exgrpo-rebuild-")
    if (Path(cache) / name).exists():
        print(f"{Path(cache) / name} exists already: give --cache an empty folder", file=sys.stderr)
        return 2
    before = os.environ.get(REBUILD_ENV_VAR)
    os.environ[REBUILD_ENV_VAR] = "1"
    try:
        built = Path(build_tiny_model(cache))
    finally:
        if before is None:
            del os.environ[REBUILD_ENV_VAR]
        else:
            os.environ[REBUILD_ENV_VAR] = before
    print(f"built {built}")
    shipped = shipped_folder(name)
    if shipped is None:
        print(f"nothing shipped for {name} to compare with")
        return 1
    same = True
    for file in REPRODUCIBLE_FILES:
        equal = sha256_of(built / file) == SHIPPED[name][file]
        same &= equal or file != "model.safetensors"
        print(f"  {file}: {'same' if equal else 'DIFFERENT'}")
    config = [json.loads((f / "config.json").read_text()) for f in (built, shipped)]
    for c in config:
        c.pop("transformers_version", None)
    print(f"  config.json (transformers_version aside): {'same' if config[0] == config[1] else 'DIFFERENT'}")
    mine, theirs = read_warm_start(str(built)), read_warm_start(str(shipped))
    print(
        f"  steps {mine['steps']} (shipped {theirs['steps']}), held-out pass@1 "
        f"{mine['final_pass1']} (shipped {theirs['final_pass1']}), cpu kernels {mine['cpu_capability']}"
    )
    print("the rebuilt weights equal the shipped ones" if same else "the rebuilt weights DIFFER from the shipped ones")
    return 0 if same else 1


def _record(args) -> int:
    folder = Path(args.folder)
    print(json.dumps({folder.name: file_digests(folder)}, indent=4))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rllib_exgrpo.models.shipped_cli", description="The tiny model shipped with the package."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="verify the shipped files against their recorded sha256").set_defaults(func=_check)
    p = sub.add_parser("rebuild", help="build the default recipe from scratch (minutes) and compare it with the shipped files")
    p.add_argument("--cache", help="cache folder to build into (default: a new temporary folder)")
    p.set_defaults(func=_rebuild)
    p = sub.add_parser("record", help="print the sha256 record of a built model folder")
    p.add_argument("folder")
    p.set_defaults(func=_record)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
