"""The ``rllib`` command of this project (Ray removed RLlib's own after 2.40).

Usage::

    rllib train file tuned_examples/exgrpo.yaml [--stop JSON] [--config JSON] ...
    rllib train -f tuned_examples/exgrpo.yaml ...          # old RLlib spelling
    rllib train file X.yaml --dry-run                      # parse + validate only

Runs classic RLlib experiment files on RLlib's **new API stack** through Ray Tune;
see :mod:`rllib_exgrpo.cli.experiment` for the file schema and the library API
(``build_experiments`` / ``run_experiments``).

Subcommands: ``train`` (here), ``evaluate`` (``cli/evaluate.py``), ``export``
(``cli/export.py``). Adding one: write
``add_<name>_parser(subparsers)`` that creates its parser and sets
``func=<handler>`` via ``set_defaults``, where the handler takes the parsed
``argparse.Namespace`` and returns an exit code; then append it to
:data:`SUBCOMMANDS`. Nothing else changes.

Exit codes: 0 all trials finished, 1 a trial errored (its error file is printed),
2 bad command line or experiment file (nothing was started), 130 interrupted.

Ray: ``--ray-address`` / ``RAY_ADDRESS`` joins a cluster; otherwise a private local
instance is started with ``ray.init(address="local")`` (never an unrelated cluster
found on the machine) without the dashboard (``--ray-ui`` turns it on), and shut
down at the end. Ray's token authentication is left as Ray configures it: on by
default in 2.60, which writes ``~/.ray/auth_token``. The local instance's ports
listen on the node's address, so the token is what keeps other users and hosts out;
a CLI should not switch that off silently. Export ``RAY_AUTH_MODE=disabled`` to opt
out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, List, Optional, Sequence

from rllib_exgrpo.cli.args import positive_int

PROG = "rllib"

_TRAIN_EPILOG = """\
experiment file (classic RLlib schema; several experiments run in file order):

  cartpole-ppo:
    run: PPO                     # ExGRPO | GRPO | RLlib name (PPO, APPO, ...) | pkg.mod:Class
    env: CartPole-v1             # registered name | gymnasium id | pkg.mod:Class
    stop: {training_iteration: 20}
    num_samples: 1
    storage_path: ./results
    checkpoint_config: {checkpoint_frequency: 5, checkpoint_at_end: true, num_to_keep: 2}
    mlflow: {tracking_uri: "sqlite:///results/mlflow.db", experiment_name: cartpole}
    config:                      # AlgorithmConfig attributes (new API stack)
      num_env_runners: 0
      lr: {grid_search: [0.0001, 0.001]}
      env_config: {}

  Unknown keys are errors (with suggestions); search spaces: grid_search, choice,
  uniform, quniform, loguniform, qloguniform, randint, qrandint, lograndint,
  qlograndint, randn, qrandn -- e.g. {loguniform: [1.0e-5, 1.0e-3]}.

examples:
  rllib train file tuned_examples/exgrpo.yaml
  rllib train file cartpole.yaml --stop '{"training_iteration": 2}' \\
      --config '{"lr": 0.0003}' --storage-path /tmp/results
  rllib train -f cartpole.yaml --dry-run

Ray: an address from --ray-address or RAY_ADDRESS is joined; otherwise a private
local instance is started (and stopped at the end). Ray's token authentication
stays as Ray configures it (on by default in 2.60; its token lives in
~/.ray/auth_token); export RAY_AUTH_MODE=disabled to opt out.
MLflow: a `mlflow:` block or --mlflow-uri adds MLflowLoggerCallback; its default
store is sqlite:///<storage_path>/mlflow.db. File stores (file:, plain paths) set
MLFLOW_ALLOW_FILE_STORE=true, which mlflow 3 requires.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# Defaults of the train options. The options are declared on both `train` (for
# `rllib train -f X.yaml ...`) and `train file` (for `rllib train file X.yaml ...`)
# with SUPPRESS defaults, so neither parser overwrites what the other parsed.
_TRAIN_DEFAULTS = {
    "config_file": None,
    "stop": None,
    "config": None,
    "env": None,
    "storage_path": None,
    "num_samples": None,
    "experiment_name": None,
    "checkpoint_freq": None,
    "checkpoint_at_end": None,
    "mlflow_uri": None,
    "verbose": 0,
    "dry_run": False,
    "rehearse": False,
    "resume": False,
    "no_validate": False,
    "ray_address": None,
    "ray_num_cpus": None,
    "ray_num_gpus": None,
    "ray_ui": False,
}


def _add_train_options(p: argparse.ArgumentParser) -> None:
    """The options shared by ``rllib train`` and ``rllib train file``, in their two help groups.

    Every default is ``SUPPRESS`` so that an option given before ``file`` is not overwritten by the
    subparser's default (``_fill_train_defaults`` fills what neither gave).
    """
    _add_experiment_overrides(p)
    _add_running_options(p)


def _add_experiment_overrides(p: argparse.ArgumentParser) -> None:
    """The options that override the experiment file's settings."""
    S = argparse.SUPPRESS
    g = p.add_argument_group("experiment overrides (apply to every experiment in the file)")
    g.add_argument(
        "--stop",
        type=_json_object,
        default=S,
        metavar="JSON",
        help="stopping criteria merged over the file's `stop`, e.g. '{\"training_iteration\": 2}'",
    )
    g.add_argument(
        "--config",
        type=_json_object,
        default=S,
        metavar="JSON",
        help="AlgorithmConfig settings deep-merged over the file's `config` (checked the same way)",
    )
    g.add_argument("--env", default=S, metavar="ENV", help="environment overriding the file's `env`")
    g.add_argument(
        "--storage-path",
        "--local-dir",
        dest="storage_path",
        default=S,
        metavar="DIR",
        help="results root (Tune storage_path); default: the file's, else ./results",
    )
    g.add_argument("--num-samples", type=positive_int, default=S, metavar="N", help="Tune samples per experiment (repeats of the grid)")
    g.add_argument(
        "--experiment-name",
        default=S,
        metavar="NAME",
        help="rename the experiment (Tune folder, MLflow experiment); the file must hold exactly one",
    )
    g.add_argument("--checkpoint-freq", type=int, default=S, metavar="N", help="checkpoint every N training iterations (0: never)")
    g.add_argument("--checkpoint-at-end", action="store_true", default=S, help="write a checkpoint when a trial ends")
    g.add_argument(
        "--mlflow-uri",
        default=S,
        metavar="URI",
        help="log to MLflow at this tracking URI (also for experiments without an `mlflow:` block)",
    )


def _add_running_options(p: argparse.ArgumentParser) -> None:
    """The options of how the command runs: verbosity, dry run / rehearsal / resume, Ray."""
    S = argparse.SUPPRESS
    r = p.add_argument_group("running")
    r.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=S,
        help="more output: -v Tune verbosity 2 and RLlib log_level INFO; -vv verbosity 3 and DEBUG",
    )
    r.add_argument(
        "--dry-run",
        action="store_true",
        default=S,
        help="parse and validate the file, print the experiments (how many of a search's trials run at "
        "once, each GPU memory plan), start nothing; --ray-num-cpus / --ray-num-gpus describe the "
        "local Ray instance to plan for",
    )
    r.add_argument(
        "--rehearse",
        action="store_true",
        default=S,
        help="run the file as written on this (CPU) machine, swapping only what it cannot hold "
        "(the model for a random one of its architecture family at tiny width, GPUs for CPU "
        "shares, token limits and batch scaled down, data files it lacks, a stand-in reward), "
        "one line per swap; results go to <name>-rehearsal (docs/rehearsal.md)",
    )
    r.add_argument(
        "--resume",
        action="store_true",
        default=S,
        help="continue each experiment of the file from its trials' latest checkpoints, "
        "up to this command's stop (the file's `stop`, --stop over it): a run killed mid-way "
        "(even with SIGKILL) goes on, and so does a finished trial below that stop (run it "
        "again with --resume and a higher training_iteration), in its own folder, its "
        "iterations numbered on; one that meets the stop, was ended early by a scheduler, or "
        "has no checkpoint stays finished (one line per trial says which); an experiment "
        "with nothing saved yet starts fresh",
    )
    r.add_argument(
        "--no-validate", action="store_true", default=S, help="skip AlgorithmConfig.validate() of the search-space variants before starting"
    )
    r.add_argument(
        "--ray-address", default=S, metavar="ADDR", help="join this Ray cluster (default: RAY_ADDRESS, else a private local instance)"
    )
    r.add_argument("--ray-num-cpus", type=int, default=S, metavar="N", help="CPUs of a local Ray instance")
    r.add_argument("--ray-num-gpus", type=int, default=S, metavar="N", help="GPUs of a local Ray instance")
    r.add_argument("--ray-ui", action="store_true", default=S, help="start the Ray dashboard with a local Ray instance")


def add_train_parser(subparsers: Any) -> None:
    train = subparsers.add_parser(
        "train",
        help="train from an experiment YAML file (classic RLlib schema, new API stack)",
        description="Train RLlib algorithms (this project's ExGRPO/GRPO, RLlib's built-ins, or "
        "any Algorithm class) from a classic RLlib experiment YAML file, on RLlib's new "
        "API stack, through Ray Tune.",
        epilog=_TRAIN_EPILOG,
        formatter_class=_Formatter,
    )
    train.add_argument(
        "-f",
        "--config-file",
        dest="config_file",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="experiment YAML file (old RLlib spelling of `train file FILE`)",
    )
    _add_train_options(train)
    train_sub = train.add_subparsers(dest="train_command", metavar="{file}")
    file_p = train_sub.add_parser(
        "file",
        help="train from an experiment YAML file",
        description="Train from an experiment YAML file.",
        epilog=_TRAIN_EPILOG,
        formatter_class=_Formatter,
    )
    file_p.add_argument("config_file", metavar="FILE", help="experiment YAML file")
    _add_train_options(file_p)
    train.set_defaults(func=run_train, _train_parser=train)


def run_train(args: argparse.Namespace) -> int:
    """Handler of ``rllib train``; returns the exit code.

    The command's flow: defaults and argument checks, the experiments built (no Ray),
    ``--dry-run`` stops there; else Ray's settings, the run, one line per outcome.
    """
    _fill_train_defaults(args)
    experiments = _build_train_experiments(args)
    if isinstance(experiments, int):  # an exit code: the file or an override is wrong
        return experiments
    if args.dry_run:
        return _dry_run(args, experiments)
    ray_init_kwargs = _ray_init_kwargs(args)
    if ray_init_kwargs is None:
        return 2
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.cli import preflight
    from rllib_exgrpo.cli.tune_runner import run_experiments
    from rllib_exgrpo.rllib.resources import ResourceError

    for exp in experiments:  # the GPU memory plan of each GPU experiment, before anything starts
        plan = preflight.memory_plan_text(exp)
        if plan:
            print(f"{PROG} train: experiment {exp.name!r}:\n{plan}", flush=True)
        for warning in exp.warnings:
            print(f"{PROG} train: experiment {exp.name!r}: {warning}", file=sys.stderr, flush=True)
    try:
        results = run_experiments(
            experiments, verbose=min(1 + args.verbose, 3), ray_address=args.ray_address, ray_init_kwargs=ray_init_kwargs, resume=args.resume
        )
    except ResourceError as e:
        return _train_error(e)
    return _report_trials(results)


def _train_error(message: Any) -> int:
    print(f"{PROG} train: error: {message}", file=sys.stderr)
    return 2


def _fill_train_defaults(args: argparse.Namespace) -> None:
    """The options neither parser set get their defaults; an experiment file is required."""
    for k, v in _TRAIN_DEFAULTS.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    if not args.config_file:
        args._train_parser.error("an experiment file is required: `rllib train file FILE` or `rllib train -f FILE`")


def _build_train_experiments(args: argparse.Namespace):
    """The experiments of the file with the command line's overrides (checked, nothing
    started), or exit code 2 after a one-line error."""
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.cli.experiment import CliConfigError, build_experiments

    overrides = dict(args.config or {})
    if args.verbose >= 1:
        overrides.setdefault("log_level", "DEBUG" if args.verbose >= 2 else "INFO")
    source = args.config_file
    try:
        if args.rehearse:
            source, overrides = _rehearsal_source(args.config_file, overrides, stop_given=args.stop is not None)
        return build_experiments(
            source,
            source_name=args.config_file,
            stop=args.stop,
            config_overrides=overrides or None,
            storage_path=args.storage_path,
            num_samples=args.num_samples,
            experiment_name=args.experiment_name,
            env=args.env,
            mlflow_uri=args.mlflow_uri,
            checkpoint_freq=args.checkpoint_freq,
            checkpoint_at_end=args.checkpoint_at_end,
            validate=not args.no_validate,
            ray_address=args.ray_address,
            ray_num_gpus=args.ray_num_gpus,
            dry_run=bool(args.dry_run),
        )
    except CliConfigError as e:
        return _train_error(e)


def _dry_run(args: argparse.Namespace, experiments: list) -> int:
    """``--dry-run``: each experiment's resources fitted to this machine (or to the local
    instance ``--ray-num-cpus`` / ``--ray-num-gpus`` describe), how many of a search's trials
    would run at once, its summary and GPU memory plan printed; nothing started."""
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.cli import preflight
    from rllib_exgrpo.cli.tune_runner import fit_experiment_resources
    from rllib_exgrpo.rllib.resources import ClusterResources, ResourceError

    here = ClusterResources.detect()
    if args.ray_num_cpus is not None or args.ray_num_gpus is not None:  # the local instance the run would start
        cpus = float(args.ray_num_cpus) if args.ray_num_cpus is not None else here.cpus
        gpus = float(args.ray_num_gpus) if args.ray_num_gpus is not None else here.gpus
        here = ClusterResources(cpus, gpus, cpus)
    for exp in experiments:
        try:  # against this machine (a cluster given by --ray-address is not contacted)
            fit_experiment_resources(exp, here)
        except ResourceError as e:
            return _train_error(e)
        print(exp.summary())
        plan = preflight.memory_plan_text(exp)  # GPU recipes only
        if plan:
            print(plan)
    print(f"{PROG} train: dry run: {len(experiments)} experiment(s) valid; nothing started.")
    return 0


def _ray_init_kwargs(args: argparse.Namespace) -> Optional[dict]:
    """``ray.init`` arguments of a local instance, or None (after a one-line error) when
    they are given for a cluster that is joined."""
    if (args.ray_address or os.environ.get("RAY_ADDRESS")) and (args.ray_num_cpus is not None or args.ray_num_gpus is not None):
        _train_error(
            "--ray-num-cpus / --ray-num-gpus size a local Ray instance; a cluster joined with "
            "--ray-address / RAY_ADDRESS has its own resources (leave them out)"
        )
        return None
    kwargs = {}
    if args.ray_num_cpus is not None:
        kwargs["num_cpus"] = args.ray_num_cpus
    if args.ray_num_gpus is not None:
        kwargs["num_gpus"] = args.ray_num_gpus
    if args.ray_ui:
        kwargs["include_dashboard"] = True
    return kwargs


def _report_trials(results: list) -> int:
    """One line per finished experiment (stdout) and per errored trial (stderr, with its
    error file's last line); exit code 1 when a trial errored, else 0."""
    failed = 0
    for res in results:
        exp = res.experiment
        where = os.path.join(exp.storage_path, exp.name)
        if res.ok:
            print(f"{PROG} train: experiment {exp.name!r}: all trials finished; results in {where}")
        for trial_path, err_file in res.errors:
            failed += 1
            reason = _last_error_line(err_file)
            print(
                f"{PROG} train: experiment {exp.name!r}: trial {trial_path} errored"
                + (f": {reason}" if reason else "")
                + f"; error file: {err_file or '(none written)'}",
                file=sys.stderr,
            )
    return 1 if failed else 0


def _rehearsal_source(path: str, overrides: dict, *, stop_given: bool):
    """The experiment file as ``--rehearse`` runs it (``cli/rehearsal.py``), each swap
    printed; the ``--config`` overrides are merged in there, so none are left."""
    # lazy: `rllib --help` and argument errors answer before torch and Ray load
    from rllib_exgrpo.cli.experiment_file import load_experiment_file
    from rllib_exgrpo.cli.rehearsal import rehearse_experiments

    data, swaps = rehearse_experiments(load_experiment_file(path), config_overrides=overrides, stop_given=stop_given)
    for name, found in swaps.items():
        for swap in found:
            print(f"{PROG} train: rehearsal: experiment {name!r}: {swap.line()}", file=sys.stderr, flush=True)
    return data, {}


def _last_error_line(err_file: Optional[str]) -> Optional[str]:
    """The exception line at the end of a trial's error file (what went wrong, in one line)."""
    try:
        lines = [ln.strip() for ln in open(err_file, encoding="utf-8", errors="replace").read().splitlines()]
    except (OSError, TypeError):
        return None
    lines = [ln for ln in lines if ln]
    return lines[-1][:500] if lines else None


#: Subcommand registry: each entry adds one subparser and sets ``func``.
SUBCOMMANDS: List[Callable[[Any], None]] = [add_train_parser]
from rllib_exgrpo.cli.evaluate import add_evaluate_parser  # noqa: E402
from rllib_exgrpo.cli.export import add_export_parser  # noqa: E402
from rllib_exgrpo.cli.compare import add_compare_parser  # noqa: E402

SUBCOMMANDS.append(add_evaluate_parser)
SUBCOMMANDS.append(add_export_parser)
SUBCOMMANDS.append(add_compare_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="RLlib command line of rllib-exgrpo: runs classic RLlib experiment YAML "
        "files on Ray RLlib's new API stack (Ray removed its own `rllib` command after 2.40).",
        epilog="Run `rllib train --help` for the experiment file schema and all options; "
        "`rllib evaluate --help`, `rllib export --help` and `rllib compare --help` for the others.",
        formatter_class=_Formatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    # `pkg.mod:Class` paths in experiment files resolve against the current directory
    # too, as under `python -m` (a console script's sys.path lacks it). Appended, so
    # installed packages win over same-named local files.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
