"""The default tiny model, built once and shipped with the package.

Building the default recipe's model takes minutes on 2 CPU cores (``tiny``), and it gives
the same bits on every x86-64 machine with AVX2 (``pinned_build``). So the package carries
that folder, built by the pinned build itself, in ``prebuilt/<cache name>/`` (weights as
safetensors, tokenizer, config, the ``warm_start.json`` report), and :data:`SHIPPED`
records the sha256 of each of its files.

When the model cache has no folder for a recipe whose cache name is shipped,
``build_tiny_model`` copies the shipped files into its temporary build folder, checks
every file's sha256 against :data:`SHIPPED` (the copy is what gets checked, so a damaged
source and a damaged copy are both caught) and renames the folder into the cache, like a
build. A mismatch (a damaged or edited install) is not an error: the loader warns, naming
the files, and builds the model from its recipe instead, which gives the recorded bits on
an AVX2 machine; only time is lost, and a damaged file never enters the cache.

Building instead of taking the shipped folder:

* ``RLLIB_EXGRPO_REBUILD_MODEL=1`` in the environment: a missing cache folder is built
  from its recipe (a folder already in the cache is used as it is: point
  ``RLLIB_EXGRPO_CACHE`` at an empty folder to rebuild everything).
* ``python -m rllib_exgrpo.models.shipped_cli rebuild``: builds the default recipe from scratch
  into a fresh folder and compares it with the shipped files (exit status 1 if the weights
  differ). ``check`` verifies the shipped files against their record (seconds);
  ``record FOLDER`` prints the record of a built folder, for a new shipped build. The
  command is a module of its own: it imports ``tiny``, which imports this module, and this
  module must not import it back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Optional

#: Where the shipped folders live inside the package.
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
#: Set to 1 to build a missing tiny model from its recipe instead of copying the shipped one.
REBUILD_ENV_VAR = "RLLIB_EXGRPO_REBUILD_MODEL"

#: sha256 of every file of each shipped folder, by cache name (``tiny-<recipe key>``).
#: ``tiny-765a7f31280b3361`` is the default recipe (version 3, seed 0): 630 steps, built
#: by the pinned build with torch 2.13.0+cpu, transformers 5.25.0, tokenizers 0.23.3; its
#: weights hash as the default recipe's builds on an AMD EPYC and an Intel Xeon
#: (docs/warm_start.md).
SHIPPED: dict[str, dict[str, str]] = {
    "tiny-765a7f31280b3361": {
        "chat_template.jinja": "e772b6ad1ea2a9b717ead97c3d9266a75e14489ec55a751b956003420d7b4981",
        "config.json": "3ad3a80c617e57724a80cfc309ca0c635cda38dfbcfd285785e82505b0e39129",
        "generation_config.json": "80d29bec172cd8e90cc64dbb4caa72debedbc439418573891b15017e26ba0b92",
        "model.safetensors": "4e691b608acf2453aa47d95a432fdf686edafda49ec5f8e82ba541ef21b04f02",
        "tokenizer.json": "21f2be5eaf61b145a7c95c3000f62a5c832249813895cefecc52604e28002497",
        "tokenizer_config.json": "0acb670d1a3c5bd962e7e052bc6afbb3aadd55f8de210eeef89533f61cadcc6a",
        "warm_start.json": "cd88280676a4fc6a7ae9f8713e69bce6c4146e428482377553a17a290198d621",
    },
    # The first hidden-operator warm start (tiny:task=operators,max_steps=2500,threads=1):
    # 2300 steps, 4098 s on one core; the operators experiments before tag tokens ran on it.
    "tiny-470596404f70d4d3": {
        "chat_template.jinja": "e772b6ad1ea2a9b717ead97c3d9266a75e14489ec55a751b956003420d7b4981",
        "config.json": "3ad3a80c617e57724a80cfc309ca0c635cda38dfbcfd285785e82505b0e39129",
        "generation_config.json": "80d29bec172cd8e90cc64dbb4caa72debedbc439418573891b15017e26ba0b92",
        "model.safetensors": "663e58dd470c5fe3a0e456d6faeded7bc64f2904b46f5ef41f0b1d5cc9239043",
        "tokenizer.json": "907e44c86f659b4e8304e028415f4b9a188eb26ee2b51ea289296edbca364ae3",
        "tokenizer_config.json": "0acb670d1a3c5bd962e7e052bc6afbb3aadd55f8de210eeef89533f61cadcc6a",
        "warm_start.json": "3ca58dba6845bd8084089d8a8b17b44fb8002488c276d08ab733120c5fecd46e",
    },
    # The hidden-operator warm start of tuned_examples/*operators_tiny.yaml, with 24 known
    # families and one token per family tag
    # (tiny:task=operators,known=24,tags=token,max_steps=2500,threads=1): reached its
    # target at step 1750, 3143 s on one core of an AMD EPYC.
    "tiny-82bf2e7e043d2d10": {
        "chat_template.jinja": "e772b6ad1ea2a9b717ead97c3d9266a75e14489ec55a751b956003420d7b4981",
        "config.json": "9889a50b9e5b4443acd1a8f4651ac13f6a7920c4d7d1a1153a9d3a111cba27ec",
        "generation_config.json": "80d29bec172cd8e90cc64dbb4caa72debedbc439418573891b15017e26ba0b92",
        "model.safetensors": "3d935daaf9579e529c500d17d8f85d3192e65c208f58aaaa27f7ced9620bfe12",
        "tokenizer.json": "9be29651f91b493a015064f549beb5123696da449df9ebbca785cfeb002e7b83",
        "tokenizer_config.json": "0acb670d1a3c5bd962e7e052bc6afbb3aadd55f8de210eeef89533f61cadcc6a",
        "warm_start.json": "ce0d346b1fdeb951357bea8a51516830ecb10fe6942a3e66246131ebb2c239ae",
    },
}

#: Files whose bits a rebuild reproduces (``warm_start.json`` holds wall times and
#: ``config.json`` the transformers version; ``rebuild`` compares their content instead).
REPRODUCIBLE_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


class ShippedModelMismatch(RuntimeError):
    """A shipped file is missing, extra, or its sha256 differs from :data:`SHIPPED`."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of each regular file directly in ``folder``, by name."""
    return {p.name: sha256_of(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}


def shipped_folder(name: str) -> Optional[Path]:
    """The package's folder for cache name ``name``, or None if none is shipped."""
    folder = PREBUILT_DIR / name
    return folder if name in SHIPPED and folder.is_dir() else None


def rebuild_requested() -> bool:
    """True when ``$RLLIB_EXGRPO_REBUILD_MODEL`` asks to build instead of copying."""
    return os.environ.get(REBUILD_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def verify(folder: Path, name: str) -> None:
    """Raise :class:`ShippedModelMismatch` unless ``folder`` holds exactly the files recorded
    for ``name`` with their recorded sha256."""
    record = SHIPPED[name]
    found = file_digests(folder)
    problems = [f"{f} missing" for f in sorted(set(record) - set(found))]
    problems += [f"{f} not in the record" for f in sorted(set(found) - set(record))]
    problems += [
        f"{f} sha256 {found[f][:12]}... != recorded {record[f][:12]}..." for f in sorted(set(found) & set(record)) if found[f] != record[f]
    ]
    if problems:
        raise ShippedModelMismatch(f"shipped model {name} in {folder}: " + "; ".join(problems))


def copy_verified(name: str, dest: Path) -> None:
    """Copy the shipped folder ``name`` into the (empty) folder ``dest`` and verify the copy.

    Raises:
        ShippedModelMismatch: a file is missing or differs from its record (``dest`` is
            then left with whatever was copied; the caller discards it).
    """
    source = PREBUILT_DIR / name
    for file in SHIPPED[name]:
        if (source / file).is_file():
            shutil.copyfile(source / file, dest / file)
    verify(dest, name)
