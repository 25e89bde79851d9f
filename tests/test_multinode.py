"""ExGRPO on a real two-node Ray cluster (two raylets on this machine, CPU only).

The cluster is started the way one is started by hand (docs/cluster.md): ``ray start
--head`` and ``ray start --address=...`` in subprocesses, each node with its own CPUs and
a custom resource that names it (``head`` / ``node2``). The env runners are pinned to
node 2 (``custom_resources_per_env_runner``), the learner to the head
(``custom_resources_per_learner``), so sampling, the learner update and the weight sync
all cross nodes. Two drivers join the same cluster, one after the other:

* ``test_exgrpo_trains_across_two_nodes``: the library API (``ExGRPOConfig().build_algo()``)
  trains two iterations; the runners and the learner report their node ids. The package
  reaches the nodes through the job's ``runtime_env`` (``py_modules``: zipped into the
  cluster, unpacked on each node), not through this checkout: the test checks where node
  2 imported it from.
* ``test_rllib_train_joins_the_cluster``: ``rllib train file X.yaml --ray-address ADDR``
  (the commands of docs/cluster.md) with the same pinning in the YAML, through Tune:
  checkpoints under ``storage_path`` and an MLflow store.

Authentication: Ray's token authentication is on across the cluster (``RAY_AUTH_MODE=token``
for every ``ray start`` and driver, all with the machine's ``~/.ray/auth_token``).

Isolation: the cluster has a private ``--temp-dir`` (its ``ray_current_cluster`` file is
written there, so no other ``ray.init()`` on the machine finds it), free ports, and the
driver is a separate process that joins it by its explicit address (``RAY_ADDRESS``
stripped from every environment), so this pytest process's own Ray (``ray_local``) is
untouched and nothing here can join another cluster. Everything is shut down in a
``finally``: SIGTERM to the two ``ray start --block`` processes (Ray then stops its
processes), SIGKILL to whatever is left in their process groups.

Run as a script (``python tests/test_multinode.py ADDRESS MODEL OUT.json``), this file is
the driver.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAD_RESOURCE, NODE2_RESOURCE = "head", "node2"
ITERATIONS, QUESTIONS, GROUP = 2, 4, 4
#: Per node: CPUs Ray may hand out and object store bytes (the tiny model needs little).
NODE_CPUS, OBJECT_STORE = 1, 200 * 1024 * 1024
#: Seconds: cluster start, the driver (imports, build, two iterations), teardown.
START_TIMEOUT, DRIVER_TIMEOUT, STOP_TIMEOUT = 90, 240, 30


# --- the driver (a separate process that joins the cluster) ----------------------------
def drive(address: str, model: str) -> dict:
    """Join the cluster at ``address``, train ``ITERATIONS`` ExGRPO iterations with the
    runners on node 2 and the learner on the head, and report where everything ran."""
    import ray
    import rllib_exgrpo

    from rllib_exgrpo.rllib.algorithm import ExGRPOConfig

    ray.init(
        address=address,
        log_to_driver=False,
        # Ship the code to every node through the cluster (what a real cluster without the
        # checkout needs); an installed copy on the nodes would do as well.
        runtime_env={"py_modules": [os.path.dirname(rllib_exgrpo.__file__)]},
    )
    try:
        nodes = _wait_alive(ray, count=2)
        config = (
            ExGRPOConfig()
            .environment(env_config={"dataset": "arithmetic"})
            .training(
                model_name_or_path=model,
                questions_per_step=QUESTIONS,
                group_size=GROUP,
                max_prompt_tokens=128,
                max_response_tokens=12,
                lr=1e-3,
                minibatch_size=16,
                loss_agg_mode="token-mean",
            )
            # Two runners on node 2 (its 1 CPU, shared), one learner on the head.
            .env_runners(
                num_env_runners=2,
                num_cpus_per_env_runner=0.4,
                custom_resources_per_env_runner={NODE2_RESOURCE: 0.1},
            )
            .learners(
                num_learners=1,
                num_cpus_per_learner=0.5,
                custom_resources_per_learner={HEAD_RESOURCE: 0.1},
            )
            # The driver is no actor here (no Tune): this only sizes its torch threads and
            # keeps fit_resources from re-sharing the CPUs above (0.5 + 0.8 + 0.5 <= 2).
            .resources(num_cpus_for_main_process=0.5)
        )
        algo = config.build_algo()
        try:
            iterations = _train_iterations(algo)
            runners, learners = _where_actors_ran(ray, algo)
        finally:
            algo.stop()
        return {
            "nodes": nodes,
            "driver_node": ray.get_runtime_context().get_node_id(),
            "runners": runners,
            "learners": learners,
            "iterations": iterations,
        }
    finally:
        ray.shutdown()


def _train_iterations(algo) -> list:
    """Train ``ITERATIONS`` iterations; the figures of each that the test checks."""
    iterations = []
    for _ in range(ITERATIONS):
        r = algo.train()
        iterations.append(
            {
                "training_iteration": int(r["training_iteration"]),
                "num_completions": int(r["num_completions"]),
                "num_episodes": int(r["env_runners"]["num_episodes"]),
                "module_steps_trained": int(r["learners"]["default_policy"]["num_module_steps_trained"]),
                "total_loss": float(r["learners"]["default_policy"]["total_loss"]),
            }
        )
    return iterations


def _where_actors_ran(ray, algo) -> tuple:
    """``(runners, learners)``: each remote env runner's index, node id and the file its
    package was imported from; each learner's node id."""

    def where_runner(runner):
        import rllib_exgrpo as pkg

        return {
            "worker_index": runner.worker_index,
            "node_id": ray.get_runtime_context().get_node_id(),
            "package": pkg.__file__,
        }

    runners = algo.env_runner_group.foreach_env_runner(where_runner, local_env_runner=False)
    learners = [
        r.get() if hasattr(r, "get") else r for r in algo.learner_group.foreach_learner(lambda _: ray.get_runtime_context().get_node_id())
    ]
    return runners, learners


def _wait_alive(ray, count: int, timeout: float = 60.0) -> dict:
    """Node id -> resource names of the alive nodes, once ``count`` are registered."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
        if len(nodes) >= count or time.monotonic() > deadline:
            return nodes
        time.sleep(0.5)


# --- the cluster ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _console_script(name: str, module: str) -> list:
    """This interpreter's ``name`` script, else ``python -m module`` (same environment)."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.is_file() else [sys.executable, "-m", module]


def _clean_env() -> dict:
    """This environment without anything that could point Ray at another cluster or put
    the checkout on the nodes' path (the code comes through the runtime_env or the
    installed package)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env.update(RAY_USAGE_STATS_ENABLED="0")
    # Token authentication on every node and driver, with the one token of this machine
    # (~/.ray/auth_token, written before the tests start: conftest.py). `ray start --head`
    # turns it on by itself when the token exists, but `ray start --address` and a driver
    # given an explicit address do not: they are told. An explicit RAY_AUTH_MODE is kept.
    env.setdefault("RAY_AUTH_MODE", "token")
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child (``ray start``, the driver) gets SIGTERM if pytest dies; a ``ray
    start --block`` then stops its node's processes, so even a killed test run leaves no
    cluster behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; the finally below is the main cleanup
        pass


class TwoNodeCluster:
    """``ray start --head`` + ``ray start --address`` (both ``--block``), private temp dir."""

    def __init__(self, root: Path):
        self.root = root
        self.ray = _console_script("ray", "ray.scripts.scripts")
        self.port = _free_port()
        import ray.util

        self.ip = ray.util.get_node_ip_address()
        self.address = f"{self.ip}:{self.port}"
        self.procs: list = []
        self.commands: list = []
        self._log_files: list = []

    def _start(self, name: str, args: list) -> subprocess.Popen:
        cmd = [
            *self.ray,
            "start",
            *args,
            f"--temp-dir={self.root / 'ray'}",
            f"--num-cpus={NODE_CPUS}",
            "--num-gpus=0",
            f"--object-store-memory={OBJECT_STORE}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--dashboard-agent-listen-port={_free_port()}",
            "--disable-usage-stats",
            "--block",
        ]
        self.commands.append(cmd)
        log = open(self.root / f"{name}.log", "w")
        self._log_files.append(log)
        proc = subprocess.Popen(
            cmd, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )
        self.procs.append((name, proc))
        return proc

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {name}.log ---\n{(self.root / f'{name}.log').read_text(errors='replace')[-chars:]}" for name, _ in self.procs
        )

    def start(self) -> None:
        # --include-dashboard=false still starts Ray's headless dashboard process: give it
        # a free port rather than the machine-wide 8265.
        head = self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--dashboard-port={_free_port()}",
                f"--resources={json.dumps({HEAD_RESOURCE: 1})}",
            ],
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # the GCS listens: the head is up
            assert head.poll() is None, f"ray start --head exited ({head.returncode})\n{self.logs()}"
            try:
                socket.create_connection((self.ip, self.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"the head did not come up\n{self.logs()}"
                time.sleep(0.5)
        self._start("node2", [f"--address={self.address}", f"--resources={json.dumps({NODE2_RESOURCE: 1})}"])
        self._wait_for_two_nodes(deadline)

    def _wait_for_two_nodes(self, deadline: float) -> None:
        """``ray start`` prints "Ray runtime started" once its node's processes are up;
        the driver then waits for the GCS to list both nodes alive (``_wait_alive``)."""
        while True:
            for name, proc in self.procs:
                assert proc.poll() is None, f"ray start ({name}) exited ({proc.returncode})\n{self.logs()}"
            if all("Ray runtime started" in (self.root / f"{n}.log").read_text(errors="replace") for n, _ in self.procs):
                return
            assert time.monotonic() < deadline, f"the nodes did not start\n{self.logs()}"
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM each ``ray start --block`` (worker first): Ray stops that node's
        processes; then SIGKILL anything still in their process groups."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group is ours (start_new_session)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(STOP_TIMEOUT)
        for log in self._log_files:
            log.close()


# --- the tests ----------------------------------------------------------------------------
def _run(cmd: list, cwd: Path, env: dict, cluster: TwoNodeCluster, what: str) -> str:
    """Run one driver process to the end (SIGKILL to its group past DRIVER_TIMEOUT);
    its output, or a failure that carries its and the nodes' logs."""
    import pytest

    # cwd outside the checkout: Ray adds the driver's cwd to every worker's sys.path.
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    try:
        log, _ = proc.communicate(timeout=DRIVER_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{what} ran past {DRIVER_TIMEOUT}s\n{log[-4000:]}\n{cluster.logs()}")
    assert proc.returncode == 0, f"{what} failed ({proc.returncode})\n{log[-6000:]}\n{cluster.logs()}"
    return log


if __name__ != "__main__":
    import pytest

    pytestmark = pytest.mark.slow

    @pytest.fixture(scope="module")
    def two_node_cluster():
        root = Path(tempfile.mkdtemp(prefix="rmn", dir="/tmp"))  # short: Unix socket paths
        cluster = TwoNodeCluster(root)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)  # failures carry the logs' tails

    def test_exgrpo_trains_across_two_nodes(two_node_cluster, quick_tiny_model, tmp_path):
        """Library API: runners on node 2, learner on the head, code via the runtime_env."""
        cluster = two_node_cluster
        out = tmp_path / "result.json"
        env = _clean_env()
        env["PYTHONPATH"] = str(REPO)  # the driver runs from the checkout; the nodes don't
        _run(
            [sys.executable, str(Path(__file__).resolve()), cluster.address, quick_tiny_model, str(out)],
            tmp_path,
            env,
            cluster,
            "the driver",
        )
        report = json.loads(out.read_text())
        print(json.dumps(report, indent=1))  # shown with -s / on failure

        nodes = report["nodes"]
        assert len(nodes) == 2, nodes
        head = next(n for n, res in nodes.items() if HEAD_RESOURCE in res)
        node2 = next(n for n, res in nodes.items() if NODE2_RESOURCE in res)
        assert head != node2
        # Every remote runner (the only ones that sample) ran on node 2, the learner on the
        # head; node 2 imported the package from the runtime_env, not from this checkout.
        runners = report["runners"]
        assert sorted(r["worker_index"] for r in runners) == [1, 2]
        assert {r["node_id"] for r in runners} == {node2}, runners
        for r in runners:
            assert not r["package"].startswith(str(REPO)), r["package"]
            assert "runtime_resources" in r["package"], r["package"]
        assert report["learners"] == [head]
        # Both iterations completed with every completion sampled and trained once.
        expected = QUESTIONS * GROUP
        assert [i["training_iteration"] for i in report["iterations"]] == list(range(1, ITERATIONS + 1))
        for it in report["iterations"]:
            assert it["num_completions"] == it["num_episodes"] == expected, it
            assert it["module_steps_trained"] == expected, it
            assert it["total_loss"] == it["total_loss"], it  # not NaN

    def test_rllib_train_joins_the_cluster(two_node_cluster, quick_tiny_model, tmp_path):
        """The CLI: ``rllib train file X.yaml --ray-address ADDR`` (docs/cluster.md) with the
        same pinning in the YAML, through Tune: checkpoints under storage_path, MLflow."""
        cluster = two_node_cluster
        results = tmp_path / "results"
        (tmp_path / "exp.yaml").write_text(
            CLUSTER_YAML.format(
                model=quick_tiny_model,
                storage=results,
                mlflow=f"sqlite:///{results}/mlflow.db",
                iterations=ITERATIONS,
                questions=QUESTIONS,
                group=GROUP,
                head=HEAD_RESOURCE,
                node2=NODE2_RESOURCE,
            )
        )
        rllib = _console_script("rllib", "rllib_exgrpo.cli.main")
        # The CLI's own ray.init has no runtime_env: the nodes import the package from the
        # installed copy (here the venv's editable install, as on a cluster built from one image).
        log = _run(
            [*rllib, "train", "file", str(tmp_path / "exp.yaml"), "--ray-address", cluster.address],
            tmp_path,
            _clean_env(),
            cluster,
            "rllib train",
        )
        assert "all trials finished" in log, log[-4000:]
        (trial,) = (results / "exgrpo-cluster").glob("ExGRPO_*")
        rows = [json.loads(line) for line in (trial / "result.json").read_text().splitlines()]
        assert [r["training_iteration"] for r in rows] == list(range(1, ITERATIONS + 1))
        for r in rows:
            assert r["num_completions"] == r["env_runners"]["num_episodes"] == QUESTIONS * GROUP
        assert sorted(c.name for c in trial.glob("checkpoint_*")) == [f"checkpoint_{i:06d}" for i in range(ITERATIONS)]
        assert (results / "mlflow.db").is_file()


#: The experiment file of test_rllib_train_joins_the_cluster (docs/cluster.md shows it).
CLUSTER_YAML = """\
exgrpo-cluster:
  run: ExGRPO
  env: rllib_exgrpo.envs.reasoning_env:ReasoningEnv
  stop: {{training_iteration: {iterations}}}
  storage_path: {storage}
  checkpoint_config: {{checkpoint_frequency: 1}}
  mlflow: {{tracking_uri: "{mlflow}", experiment_name: exgrpo-cluster}}
  config:
    env_config: {{dataset: arithmetic}}
    model_name_or_path: "{model}"
    questions_per_step: {questions}
    group_size: {group}
    max_response_tokens: 12
    minibatch_size: 16
    num_env_runners: 2
    num_cpus_per_env_runner: 0.4
    custom_resources_per_env_runner: {{{node2}: 0.1}}
    num_learners: 1
    num_cpus_per_learner: 0.5
    custom_resources_per_learner: {{{head}: 0.1}}
    num_cpus_for_main_process: 0.5
    custom_resources_for_main_process: {{{head}: 0.1}}
"""


if __name__ == "__main__":
    address, model, out_path = sys.argv[1:4]
    Path(out_path).write_text(json.dumps(drive(address, model)))
