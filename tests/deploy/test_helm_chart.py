"""The Helm chart (deploy/helm/backfill), rendered with `helm template`, held to what the app
really reads: every BACKFILL_* variable is a settings field (or read by the code directly),
the settings production needs are set, the containers run real `backfill` commands with real
options, the probes and the ServiceMonitor ask for real routes, the worker outlives its drains'
grace, and KEDA watches the Redis lists the Celery queues really are.

Helm comes from `bash scripts/helm.sh --install` (.helm/bin/helm), $BACKFILL_HELM or PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import typer
import yaml

import backfill
from backfill.cli import app as cli_app
from backfill.storage.broker import QueueName
from backfill.storage.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "backfill"
PRODUCTION = CHART / "values-production.yaml"


def _helm() -> str | None:
    for candidate in (os.environ.get("BACKFILL_HELM"), str(ROOT / ".helm" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


HELM = _helm()
pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm is not installed: `bash scripts/helm.sh --install` puts it in .helm/bin"
)

# The renders every test runs on: the default values, the production example, the optional
# parts turned the other way, and a broker URL with a password, TLS and a database of its own.
RENDERS: dict[str, list[str]] = {
    "default": [],
    "production": ["-f", str(PRODUCTION)],
    "variants": [
        *("--set", "api.autoscaling.enabled=false", "--set", "worker.autoscaling.enabled=false"),
        *("--set", "serviceMonitor.enabled=true", "--set", "networkPolicy.enabled=true"),
        *("--set", "metrics.token.enabled=false", "--set", "worker.concurrency=6"),
        *("--set", "metrics.sharedClaim=backfill-metrics", "--set", "config.max_inflight=128"),
    ],
    "broker-password": [
        *("--set", "secrets.brokerUrl=rediss://backfill:s3cret@redis.cache:6380/3"),
        *("--set", "secrets.adminApiKey=adm-0123456789abcdef0123", "--set", "serviceMonitor.enabled=true"),
        *(
            "--set-json",
            'fleet.deployments=[{"name":"a","frontendUrl":"http://a:8000/v1"},'
            '{"name":"b","frontendUrl":"http://b:8000/v1","metrics":[{"role":"decode","url":"http://b-d:9090/metrics"}]}]',
        ),
    ],
    "overflow": [
        *("--set", "networkPolicy.enabled=true", "--set", "config.overflow_urls=https://overflow.example.com/v1"),
        *("--set", "secrets.overflowApiKey=ovf-0123456789abcdef", "--set", "secrets.fleetApiKey=flt-0123456789"),
    ],
}

WORKLOADS = ("Deployment", "Job")
SERVICES = ("api", "worker", "scheduler")  # the long-running components


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    env.update(
        HELM_CACHE_HOME=str(tmp / "cache"), HELM_CONFIG_HOME=str(tmp / "config"), HELM_DATA_HOME=str(tmp / "data")
    )
    return env


def helm_template(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run(
        [HELM, "template", "backfill", str(CHART), "--namespace", "backfill", *args],
        capture_output=True,
        text=True,
        env=_env(tmp),
        timeout=120,
    )


class Rendered:
    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = docs

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        (doc,) = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        return doc

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        return found[0] if found else None

    def workloads(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """(workload, container) for every container the chart runs."""
        for doc in self.docs:
            if doc["kind"] in WORKLOADS:
                for container in doc["spec"]["template"]["spec"]["containers"]:
                    yield doc, container

    def component(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        (found,) = [
            (d, c)
            for d, c in self.workloads()
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == name and d["kind"] == "Deployment"
        ]
        return found

    def secret_values(self, name: str) -> dict[str, str] | None:
        """A Secret the chart renders (None: one made outside the chart, an existingSecret)."""
        doc = self.find("Secret", name)
        if doc is None:
            return None
        return dict(doc.get("stringData") or {})

    def environment(self, container: dict[str, Any]) -> dict[str, tuple[str, Any]]:
        """name -> (where, value): ("value", literal), ("configmap", literal), ("secret", ref)."""
        env: dict[str, tuple[str, Any]] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                data = self.one("ConfigMap", source["configMapRef"]["name"])["data"]
                env.update({k: ("configmap", v) for k, v in data.items()})
            elif "secretRef" in source:
                values = self.secret_values(source["secretRef"]["name"]) or {}
                env.update({k: ("secret", {"name": source["secretRef"]["name"], "key": k}) for k in values})
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = ("value", item["value"])
            elif "secretKeyRef" in item.get("valueFrom", {}):
                env[item["name"]] = ("secret", item["valueFrom"]["secretKeyRef"])
            else:
                env[item["name"]] = ("other", item.get("valueFrom"))
        return env

    def resolved(self, container: dict[str, Any]) -> dict[str, str]:
        """The variables as the container would see them. A key of a Secret made outside the
        chart stands in as a placeholder when its reference is required, and is left out when
        it is optional (it may be absent)."""
        out: dict[str, str] = {}
        for name, (where, value) in self.environment(container).items():
            if where in ("value", "configmap"):
                out[name] = str(value)
            elif where == "secret":
                values = self.secret_values(value["name"])
                if values is None:
                    if not value.get("optional"):
                        out[name] = f"<{value['key']} of secret {value['name']}>"
                elif value["key"] in values:
                    out[name] = values[value["key"]]
                else:
                    assert value.get("optional"), f"{name}: key {value['key']} is not in secret {value['name']}"
        return out


@pytest.fixture(scope="module", params=list(RENDERS))
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    result = helm_template(tmp_path_factory.mktemp("helm"), *RENDERS[request.param])
    assert result.returncode == 0, result.stderr
    return Rendered([d for d in yaml.safe_load_all(result.stdout) if d])


# --- environment -------------------------------------------------------------------------

SETTINGS_VARS = {f"{Settings.model_config['env_prefix']}{name}".upper() for name in Settings.model_fields}


def _read_directly(name: str) -> bool:
    """Whether backfill's own code reads the variable from the environment (not a setting)."""
    pattern = re.compile(rf"""(environ\.get\(|environ\[|getenv\()\s*["']{re.escape(name)}["']""")
    for folder, _, files in os.walk(Path(backfill.__file__).parent, followlinks=True):
        for file in files:
            if file.endswith(".py") and pattern.search((Path(folder) / file).read_text(encoding="utf-8")):
                return True
    return False


def test_settings_read_the_backfill_prefix() -> None:
    assert Settings.model_config["env_prefix"] == "BACKFILL_"
    assert "BACKFILL_DRAIN_GRACE_S" in SETTINGS_VARS and "BACKFILL_FLEET_METRICS_URLS" in SETTINGS_VARS


def test_every_backfill_variable_is_read_by_the_app(rendered: Rendered) -> None:
    names = {name for _, c in rendered.workloads() for name in rendered.environment(c)}
    names |= {k for cm in rendered.of_kind("ConfigMap") for k in cm.get("data", {})}
    names |= {k for s in rendered.of_kind("Secret") for k in (s.get("stringData") or {})}
    unknown = {n for n in names if n.startswith("BACKFILL_") and n not in SETTINGS_VARS and not _read_directly(n)}
    assert not unknown, f"the app reads none of {sorted(unknown)}"


@pytest.fixture
def settings_of(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def build(env: dict[str, str]) -> Settings:
        for key in list(os.environ):
            if key.startswith("BACKFILL_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return Settings(_env_file=None)  # type: ignore[call-arg]

    yield build


@pytest.mark.parametrize("component", SERVICES)
def test_each_service_has_the_production_settings(rendered: Rendered, component: str, settings_of: Any) -> None:
    _, container = rendered.component(component)
    env = rendered.resolved(container)
    s = settings_of(env)
    assert s.environment == "production"
    assert s.database_url and not s.embedded, "no BACKFILL_DATABASE_URL: the app would use SQLite in the pod"
    assert s.broker_url, "no BACKFILL_BROKER_URL: the app would use a broker folder in the pod"
    assert s.s3_endpoint_url, "no BACKFILL_S3_ENDPOINT_URL: the app would keep objects on the pod's disk"
    assert s.s3_bucket
    assert s.fleet_urls, "no BACKFILL_FLEET_URLS"
    if s.fleet_metrics_urls:
        assert len(s.fleet_metrics) == len(s.fleet_urls)
    s.check_production()  # configured keys are not development secrets
    # The metrics directory is a writable volume, not the read-only root filesystem.
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    assert s.metrics_dir in mounts
    if container.get("securityContext", {}).get("readOnlyRootFilesystem"):
        assert "/tmp" in mounts


def test_the_api_gets_the_keys_and_the_metrics_token(rendered: Rendered) -> None:
    _, container = rendered.component("api")
    env = rendered.environment(container)
    assert {"BACKFILL_BOOTSTRAP_API_KEY", "BACKFILL_ADMIN_API_KEY"} <= set(env)
    config = rendered.of_kind("ConfigMap")
    token = env.get("BACKFILL_METRICS_TOKEN")
    if token is not None:
        where, ref = token
        assert where == "secret" and not ref.get("optional")
        values = rendered.secret_values(ref["name"])
        assert values is None or values.get(ref["key"]), "the metrics token is empty: /metrics would be open"
    assert all("BACKFILL_METRICS_TOKEN" not in c["data"] for c in config), "a token belongs in a Secret"


def test_the_migrations_job_reaches_the_database(rendered: Rendered, settings_of: Any) -> None:
    jobs = rendered.of_kind("Job")
    if not jobs:
        return
    (job,) = jobs
    hooks = set(job["metadata"]["annotations"]["helm.sh/hook"].split(","))
    assert {"pre-install", "pre-upgrade"} <= hooks
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["backfill", "migrate"]
    env = rendered.environment(container)
    where, ref = env["BACKFILL_DATABASE_URL"]
    assert where == "secret" and not ref.get("optional")
    secret = rendered.find("Secret", ref["name"])
    if secret is not None:
        # Made by the chart: it must exist before the Job, so it is an earlier hook.
        annotations = secret["metadata"].get("annotations", {})
        assert "pre-install" in annotations.get("helm.sh/hook", "")
        assert int(annotations["helm.sh/hook-weight"]) < int(job["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert not settings_of(rendered.resolved(container)).embedded
    assert not container.get("envFrom"), "hooks run before the release's ConfigMap exists"


# --- commands and probes -----------------------------------------------------------------

# The `backfill` command as typer builds it (typer carries its own click: a group by its commands).
CLI: Any = typer.main.get_command(cli_app)


def test_containers_run_real_cli_commands(rendered: Rendered) -> None:
    seen = set()
    for doc, container in rendered.workloads():
        command = [*container.get("command", []), *container.get("args", [])]
        assert command[0] == "backfill", f"{doc['metadata']['name']}: {command}"
        sub = CLI.commands.get(command[1])
        assert sub is not None, f"`backfill {command[1]}` is not a command ({sorted(CLI.commands)})"
        # Parsed as `backfill` would parse them: an unknown option or a bad value raises.
        sub.make_context(command[1], list(command[2:]), resilient_parsing=False)
        seen.add(command[1])
    assert {"api", "worker", "scheduler"} <= seen


def test_the_api_listens_where_its_port_says(rendered: Rendered) -> None:
    _, container = rendered.component("api")
    args = container["command"]
    ctx = CLI.commands["api"].make_context("api", list(args[2:]))
    assert ctx.params["host"] == "0.0.0.0"
    (port,) = [p for p in container["ports"] if p["name"] == "http"]
    assert ctx.params["port"] == port["containerPort"]


@pytest.fixture(scope="module")
def is_route() -> Any:
    """Whether the app answers GET on a path with one of its routes (matched as Starlette
    matches a request: routers included into the app hold their routes themselves)."""
    from starlette.routing import Match

    from backfill.api.app import create_app

    app = create_app()

    def matches(path: str) -> bool:
        scope = {"type": "http", "path": path, "method": "GET", "root_path": "", "headers": [], "query_string": b""}
        return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)

    assert matches("/health") and not matches("/no-such-route")
    return matches


def test_probes_ask_for_real_routes(rendered: Rendered, is_route: Any) -> None:
    for doc, container in rendered.workloads():
        ports = {p["name"] for p in container.get("ports", [])} | {
            p["containerPort"] for p in container.get("ports", [])
        }
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            if "exec" in probe:  # the scheduler's own check of its progress file
                assert probe["exec"]["command"][:2] == ["backfill", "scheduler-alive"], probe
                assert f"--alive-file={probe['exec']['command'][2]}" in container["command"]
                continue
            # Only the API serves anything over the network.
            assert set(probe) & {"httpGet", "exec", "tcpSocket", "grpc"} == {"httpGet"}, f"{kind}: {probe}"
            assert is_route(probe["httpGet"]["path"]), f"{doc['metadata']['name']} {kind}: no route {probe}"
            assert probe["httpGet"]["port"] in ports
    _, api = rendered.component("api")
    assert api["livenessProbe"]["httpGet"]["path"] == "/health"  # answers while the process runs
    assert api["readinessProbe"]["httpGet"]["path"] == "/ready"  # its dependencies answer
    _, worker = rendered.component("worker")
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(worker)
    _, scheduler = rendered.component("scheduler")
    assert set(scheduler["livenessProbe"]) >= {"exec", "periodSeconds", "failureThreshold"}
    assert "withinSeconds" not in scheduler["livenessProbe"]


def test_the_service_monitor_scrapes_metrics_with_the_token(rendered: Rendered, is_route: Any) -> None:
    monitors = rendered.of_kind("ServiceMonitor")
    if not monitors:
        return
    (monitor,) = monitors
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = rendered.one("Service", monitor["metadata"]["name"])
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and is_route(endpoint["path"])
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    _, api = rendered.component("api")
    token = rendered.environment(api).get("BACKFILL_METRICS_TOKEN")
    if token is None:
        assert "authorization" not in endpoint
    else:
        credentials = endpoint["authorization"]["credentials"]
        assert endpoint["authorization"]["type"] == "Bearer"
        assert (credentials["name"], credentials["key"]) == (token[1]["name"], token[1]["key"])


# --- scaling, shutdown, disruption -------------------------------------------------------


def test_the_worker_outlives_its_drains_grace(rendered: Rendered, settings_of: Any) -> None:
    deployment, container = rendered.component("worker")
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain_grace = settings_of(rendered.resolved(container)).drain_grace_s
    assert grace > drain_grace


def test_keda_watches_the_celery_queues(rendered: Rendered) -> None:
    scaled = rendered.of_kind("ScaledObject")
    worker, container = rendered.component("worker")
    if not scaled:
        assert "replicas" in worker["spec"]
        return
    (obj,) = scaled
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    assert obj["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert "replicas" not in worker["spec"], "KEDA owns the worker's replica count"
    triggers = obj["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis"}
    assert sorted(t["metadata"]["listName"] for t in triggers) == sorted(q.value for q in QueueName)
    # The broker's Redis, when the chart knows its URL.
    broker = rendered.resolved(container)["BACKFILL_BROKER_URL"]
    if "://" in broker:
        url = urlparse(broker)
        for t in triggers:
            assert t["metadata"]["address"] == f"{url.hostname}:{url.port or 6379}"
            assert t["metadata"]["databaseIndex"] == (url.path.strip("/") or "0")
            assert t["metadata"]["enableTLS"] == str(url.scheme == "rediss").lower()
        if url.password:
            auth = rendered.one("TriggerAuthentication", triggers[0]["authenticationRef"]["name"])
            refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
            assert rendered.secret_values(refs["password"]["name"])[refs["password"]["key"]] == url.password  # type: ignore[index]
    for t in triggers:
        if "authenticationRef" in t:
            assert rendered.find("TriggerAuthentication", t["authenticationRef"]["name"]) is not None


def test_celery_queues_are_redis_lists_of_their_names() -> None:
    """What KEDA's listName relies on: kombu's Redis transport keeps a queue's messages (sent
    without a priority, as backfill sends them) in a list named after the queue."""
    from kombu.transport.redis import Channel

    from backfill.storage.broker import get_celery_app

    celery_app = get_celery_app()
    assert celery_app.conf.task_default_priority is None
    assert "global_keyprefix" not in (celery_app.conf.broker_transport_options or {})
    channel = Channel.__new__(Channel)
    channel.priority_steps = Channel.priority_steps
    for queue in QueueName:
        assert channel._q_for_pri(queue.value, 0) == queue.value


def test_the_api_autoscales_on_cpu(rendered: Rendered) -> None:
    api, container = rendered.component("api")
    hpas = rendered.of_kind("HorizontalPodAutoscaler")
    if not hpas:
        assert api["spec"]["replicas"] >= 1
        return
    (hpa,) = hpas
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == api["metadata"]["name"]
    assert "replicas" not in api["spec"]
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert container["resources"]["requests"]["cpu"], "a CPU utilization target needs a CPU request"


def test_two_schedulers_and_a_budget_for_each_service(rendered: Rendered) -> None:
    scheduler, _ = rendered.component("scheduler")
    assert scheduler["spec"]["replicas"] == 2
    budgets = {
        p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        for p in rendered.of_kind("PodDisruptionBudget")
    }
    assert budgets == set(SERVICES)


INTERNAL = {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "127.0.0.0/8"}
# Not the internet either: "this network", IETF protocol assignments, benchmarking, multicast and
# the reserved block above it; NAT64 and 6to4, which lead back to IPv4 addresses.
SPECIAL = {"0.0.0.0/8", "192.0.0.0/24", "198.18.0.0/15", "224.0.0.0/3"}
SPECIAL_V6 = {"64:ff9b::/96", "2002::/16"}


def test_webhook_egress_skips_the_internal_ranges(rendered: Rendered) -> None:
    policies = rendered.of_kind("NetworkPolicy")
    if not policies:
        return
    blocks = [
        peer["ipBlock"]
        for p in policies
        for rule in p["spec"].get("egress", [])
        for peer in rule.get("to", [])
        if "ipBlock" in peer
    ]
    open_v4 = [b for b in blocks if b["cidr"] == "0.0.0.0/0"]
    assert open_v4, "no egress to the internet for webhooks"
    for block in open_v4:
        assert INTERNAL | SPECIAL <= set(block.get("except", []))
    for block in blocks:
        if block["cidr"] == "::/0":
            assert {"fc00::/7", "fe80::/10", "::1/128"} | SPECIAL_V6 <= set(block.get("except", []))
    # Only the scheduler sends webhooks, so only it reaches the internet; and the workers, when
    # overflow deployments are configured (they send escalated lines there).
    overflow = any(cm["data"].get("BACKFILL_OVERFLOW_URLS") for cm in rendered.of_kind("ConfigMap") if cm.get("data"))
    for p in policies:
        if any(
            peer.get("ipBlock", {}).get("cidr") == "0.0.0.0/0"
            for r in p["spec"].get("egress", [])
            for peer in r.get("to", [])
        ):
            component = p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            assert component == "scheduler" or (overflow and component == "worker"), p["metadata"]["name"]


def test_the_overflow_key_is_a_secret_the_workers_alone_read_and_its_egress_is_open(rendered: Rendered) -> None:
    overflow = [
        cm["data"]["BACKFILL_OVERFLOW_URLS"]
        for cm in rendered.of_kind("ConfigMap")
        if cm.get("data", {}).get("BACKFILL_OVERFLOW_URLS")
    ]
    for _, container in rendered.workloads():
        env = rendered.environment(container)
        if "BACKFILL_OVERFLOW_API_KEY" in env:
            where, _ = env["BACKFILL_OVERFLOW_API_KEY"]
            assert where == "secret", "the overflow's key in plain text"
            assert container["name"] == "worker"
    for cm in rendered.of_kind("ConfigMap"):
        assert "BACKFILL_OVERFLOW_API_KEY" not in cm.get("data", {})
    if not overflow:
        return
    _, worker = rendered.component("worker")
    assert rendered.environment(worker)["BACKFILL_OVERFLOW_API_KEY"][0] == "secret"
    if not rendered.of_kind("NetworkPolicy"):
        return
    (policy,) = [p for p in rendered.of_kind("NetworkPolicy") if p["metadata"]["name"].endswith("-overflow")]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    (rule,) = policy["spec"]["egress"]
    assert {peer["ipBlock"]["cidr"] for peer in rule["to"]} == {"0.0.0.0/0", "::/0"}
    assert rule["ports"] == [{"port": 443, "protocol": "TCP"}]


# --- the chart refuses what the app would get wrong ----------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "worker.terminationGracePeriodSeconds=20"], "must be above worker.drainGraceSeconds"),
        (["--set", "config.database_url=sqlite://"], "config.database_url"),
        (["--set", "config.Max-Inflight=3"], "field name"),
        (["--set", "s3.endpointUrl="], "s3.endpointUrl is required"),
        (["--set", "secrets.adminApiKey=sk-dev-0123456789abcdefgh"], "BACKFILL_ADMIN_API_KEY"),
        (["--set", "secrets.existingSecret=mine"], "worker.autoscaling.redis.address is required"),
        (
            [
                *("--set", "networkPolicy.enabled=true"),
                *("--set-json", 'networkPolicy.apiIngressFrom=[{"namespaceSelector":{"matchLabels":{"n":"ingress"}}}]'),
            ],
            "api.forwardedAllowIps",
        ),
        (["--set", "config.overflow_api_key=sk-plain"], "config.overflow_api_key"),
        (
            [
                "--set-json",
                'fleet.deployments=[{"name":"a","frontendUrl":"http://a/v1","metrics":[{"role":"gpu","url":"http://x"}]}]',
            ],
            "role",
        ),
    ],
)
def test_the_chart_refuses(tmp_path: Path, args: list[str], message: str) -> None:
    result = helm_template(tmp_path, *args)
    assert result.returncode != 0
    assert message in result.stderr
