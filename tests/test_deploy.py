"""The deployment files under deploy/: Dockerfile, compose stack, Prometheus config and alert
rules, Grafana dashboard, Kubernetes manifests and the launchd plist.

Offline checks only. Tools beyond the test extras (each check skips when its tool is absent):
promtool and prometheus (Debian's `prometheus`), kubernetes-validate and check-jsonschema
(PyPI), kubectl (optional, for `kubectl kustomize`).
"""

from __future__ import annotations

import json
import plistlib
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from factories import PROMTOOL_ABSENT, prometheus_tool_absent

from metrics import METRIC_NAMES, EngineMetrics, HTTPMetrics

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "flashbatch.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
K8S = DEPLOY / "k8s"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
METRIC_RE = re.compile(r"\bflashbatch_[A-Za-z0-9_]+")
SERVE = ["flashbatch", "serve", "--host", "0.0.0.0", "--port", "8000"]

# Dashboard panels that must exist, and what each one's queries must contain.
PANELS = {
    "Output throughput": [r"rate\(flashbatch_generation_tokens_total\{"],
    "Prompt throughput": [r"rate\(flashbatch_prompt_tokens_total\{"],
    "Request rate by finished reason": [
        r"sum by \(finished_reason\) \(rate\(flashbatch_request_success_total\{"
    ],
    "Time to first token": [
        rf"histogram_quantile\({q}, sum by \(le\) \(rate\("
        r"flashbatch_time_to_first_token_seconds_bucket\{"
        for q in ("0.5", "0.9", "0.99")
    ],
    "Inter-token latency": [
        rf"histogram_quantile\({q}, sum by \(le\) \(rate\("
        r"flashbatch_inter_token_latency_seconds_bucket\{"
        for q in ("0.5", "0.9", "0.99")
    ],
    "End-to-end request latency": [
        rf"histogram_quantile\({q}, sum by \(le\) \(rate\("
        r"flashbatch_e2e_request_latency_seconds_bucket\{"
        for q in ("0.5", "0.9", "0.99")
    ],
    "Running and waiting requests": [
        r"flashbatch_num_requests_running\{",
        r"flashbatch_num_requests_waiting\{",
    ],
    "KV cache usage": [r"flashbatch_kv_cache_usage_perc\{"],
    "Prefix cache hit rate": [
        r"rate\(flashbatch_prefix_cache_hits_total\{.*/ sum by \(instance\) "
        r"\(rate\(flashbatch_prefix_cache_queries_total\{"
    ],
    "Draft acceptance rate": [
        r"rate\(flashbatch_spec_decode_num_accepted_tokens_total\{.*\)\) / "
        r"sum by \(model_name\) \(rate\(flashbatch_spec_decode_num_draft_tokens_total\{"
    ],
    "Mean acceptance length": [
        r"^1 \+ sum by \(model_name\) \(rate\(flashbatch_spec_decode_num_accepted_tokens_total"
        r"\{.*\)\) / sum by \(model_name\) \(rate\(flashbatch_spec_decode_num_drafts_total\{"
    ],
    "Per-position acceptance": [
        r"sum by \(position\) \(rate\(flashbatch_spec_decode_num_accepted_tokens_per_pos_total"
        r"\{.*/ on\(\) group_left sum\(rate\(flashbatch_spec_decode_num_drafts_total\{"
    ],
    "Draft depth distribution": [r"flashbatch_spec_decode_draft_depth_bucket\{"],
    "Acceptance rate by source": [
        r"sum by \(model_name, source\) \(rate\(flashbatch_spec_decode_num_accepted_tokens_total"
        r"\{.*/ sum by \(model_name, source\) \(rate\("
        r"flashbatch_spec_decode_num_draft_tokens_total\{"
    ],
    "Draft and accepted tokens by source": [
        r"sum by \(model_name, source\) \(rate\(flashbatch_spec_decode_num_draft_tokens_total\{",
        r"sum by \(model_name, source\) \(rate\(flashbatch_spec_decode_num_accepted_tokens_total\{",
    ],
    "Drafting rows by source": [
        r"sum by \(model_name, source\) \(rate\(flashbatch_spec_decode_draft_depth_count\{",
    ],
    "Parked steps by reason": [
        r"sum by \(reason\) \(rate\(flashbatch_spec_decode_parked_steps_total\{"
    ],
    "Step duration by phase": [
        rf"histogram_quantile\({q}, sum by \(phase, le\) \(rate\("
        r"flashbatch_step_duration_seconds_bucket\{"
        for q in ("0.5", "0.9")
    ],
    "Batch size": [r"flashbatch_batch_size\{"],
    "MLX memory": [r"flashbatch_mlx_active_memory_bytes\{", r"flashbatch_mlx_peak_memory_bytes\{"],
    "Client disconnects and server closes": [
        r"sum by \(phase\) \(rate\(flashbatch_http_requests_client_disconnected_total\{",
        r"sum by \(reason\) \(rate\(flashbatch_http_connections_closed_by_server_total\{",
    ],
}
ALERT_NAMES = {
    "FlashbatchEngineDown",
    "FlashbatchHighQueue",
    "FlashbatchHighTTFT",
    "FlashbatchKVCacheFull",
    "FlashbatchRequestErrors",
    "FlashbatchRequestAborts",
    "FlashbatchAcceptanceCollapse",
}


# ----------------------------------------------------------------------------- loading
def _yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels += panel.get("panels", [])  # collapsed rows hold their panels
    return panels


def _dashboard_targets() -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in _panels(_dashboard()) for t in p.get("targets", [])]


def _dashboard_exprs() -> list[str]:
    exprs = [t["expr"] for _, t in _dashboard_targets()]
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def _rules(groups: list[dict]) -> list[dict]:
    return [rule for group in groups for rule in group["rules"]]


def _alert_groups() -> list[dict]:
    return yaml.safe_load(ALERTS.read_text())["groups"]


def _k8s_resources() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in _yaml_docs(K8S / name)]


def _k8s(kind: str) -> dict:
    (doc,) = [d for d in _k8s_resources() if d["kind"] == kind]
    return doc


def _container() -> dict:
    (container,) = _k8s("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def _promql_sources() -> dict[str, list[str]]:
    scaled = _k8s("ScaledObject")
    return {
        "dashboard": _dashboard_exprs(),
        "alerts.yml": [r["expr"] for r in _rules(_alert_groups())],
        "PrometheusRule": [r["expr"] for r in _rules(_k8s("PrometheusRule")["spec"]["groups"])],
        "ScaledObject": [t["metadata"]["query"] for t in scaled["spec"]["triggers"]],
    }


def _grafana_to_promql(expr: str, model: str = ".*", rate_interval: str = "1m") -> str:
    values = {"model_name": model, "instance": ".*", "__rate_interval": rate_interval}

    def substitute(match: re.Match) -> str:
        assert match.group(1) in values, f"unknown dashboard variable ${match.group(1)}"
        return values[match.group(1)]

    return re.sub(r"\$(\w+)", substitute, expr)


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(PROMTOOL_ABSENT)
    return path


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


# ----------------------------------------------------------------------------- metrics
@pytest.mark.parametrize("source", ["dashboard", "alerts.yml", "PrometheusRule", "ScaledObject"])
def test_every_queried_metric_is_exported(source):
    exprs = _promql_sources()[source]
    names = {name for expr in exprs for name in METRIC_RE.findall(expr)}
    assert names, f"no flashbatch_ metric found in the {source} queries"
    missing = sorted(names - set(METRIC_NAMES))
    assert not missing, f"{source} queries metrics the engine does not export: {missing}"


def test_dashboard_charts_every_metric_family():
    used = {name for expr in _dashboard_exprs() for name in METRIC_RE.findall(expr)}
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in METRIC_NAMES}
    charted = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert not families - charted, f"exported but not on the dashboard: {families - charted}"


# ----------------------------------------------------------------------------- dashboard
def test_dashboard_has_the_panels():
    dashboard = _dashboard()
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    by_title = {p["title"]: p for p in panels}
    assert len(by_title) == len(panels), "duplicate panel titles"
    assert len({p["id"] for p in _panels(dashboard)}) == len(_panels(dashboard)), "duplicate ids"
    for title, patterns in PANELS.items():
        assert title in by_title, f"missing panel {title!r}"
        exprs = [t["expr"] for t in by_title[title]["targets"]]
        for pattern in patterns:
            assert any(re.search(pattern, e) for e in exprs), f"{title}: no query ~ {pattern}"
    assert by_title["Draft depth distribution"]["type"] in {"heatmap", "barchart", "bargauge"}
    for panel in panels:
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'model_name=~"$model_name"' in target["expr"], (panel["title"], target)


def test_dashboard_variables():
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${datasource}"
    assert "model_name)" in model["definition"]
    for name, variable in variables.items():
        if variable.get("includeAll"):
            assert variable["allValue"] == ".*", name


def test_dashboard_queries_parse(tmp_path):
    """Every panel query, Grafana variables filled in, is valid PromQL for promtool."""
    promtool = _promtool()
    rules = [
        {"record": f"flashbatch:dashboard_query_{i}", "expr": _grafana_to_promql(expr)}
        for i, expr in enumerate(_dashboard_exprs())
        if not expr.startswith("label_values(")
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- prometheus
def test_alert_rules_pass_promtool():
    promtool = _promtool()
    result = _run(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules(_alert_groups()))} rules found" in result.stdout


def test_alert_rules_unit_tests():
    """deploy/prometheus/alerts_test.yml: each alert fires on its condition, and only then."""
    promtool = _promtool()
    result = _run(promtool, "test", "rules", "alerts_test.yml", cwd=DEPLOY / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr
    tested = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())
    fired = {
        case["alertname"]
        for test in tested["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert fired == ALERT_NAMES, "every alert needs a unit test where it fires"


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-host.yml"])
def test_prometheus_config(config):
    promtool = _promtool()
    result = _run(promtool, "check", "config", config, cwd=DEPLOY / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr
    parsed = yaml.safe_load((DEPLOY / "prometheus" / config).read_text())
    assert parsed["rule_files"] == ["alerts.yml"]
    (job,) = [j for j in parsed["scrape_configs"] if j["job_name"] == "flashbatch"]
    assert job["metrics_path"] == "/metrics" and job["scrape_interval"] == "5s"
    (target,) = job["static_configs"][0]["targets"]
    assert target.endswith(":8000")


def test_alerts():
    rules = {r["alert"]: r for r in _rules(_alert_groups())}
    assert [g["name"] for g in _alert_groups()] == ["flashbatch"]
    assert set(rules) == ALERT_NAMES
    assert rules["FlashbatchEngineDown"]["expr"].strip() == 'up{job="flashbatch"} == 0'
    assert "flashbatch_num_requests_waiting >" in rules["FlashbatchHighQueue"]["expr"]
    assert rules["FlashbatchHighQueue"]["for"] == "5m"
    assert "histogram_quantile(0.99" in rules["FlashbatchHighTTFT"]["expr"]
    assert "flashbatch_kv_cache_usage_perc >" in rules["FlashbatchKVCacheFull"]["expr"]
    assert 'finished_reason="error"' in rules["FlashbatchRequestErrors"]["expr"]
    assert 'finished_reason="abort"' in rules["FlashbatchRequestAborts"]["expr"]
    collapse = rules["FlashbatchAcceptanceCollapse"]
    assert collapse["for"] == "15m" and "< 0.1" in collapse["expr"]
    assert "flashbatch_spec_decode_num_drafts_total" in collapse["expr"]  # only while drafting
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_prometheus_rule_equals_alerts_yml():
    rule = _k8s("PrometheusRule")
    assert rule["spec"]["groups"] == _alert_groups()


# ----------------------------------------------------------------------------- kubernetes
def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    kinds = sorted(d["kind"] for d in _k8s_resources())
    assert kinds == sorted(["Deployment", "Service", *CRD_KINDS])
    kubectl = shutil.which("kubectl")
    if kubectl:  # optional: the real kustomize build
        result = _run(kubectl, "kustomize", str(K8S))
        assert result.returncode == 0, result.stderr
        assert sorted(d["kind"] for d in yaml.safe_load_all(result.stdout) if d) == kinds


def test_k8s_manifests_validate_against_schemas():
    validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import SchemaNotFoundError

    checked = 0
    for doc in _k8s_resources():
        try:
            validate.validate(doc, validate.latest_version(), strict=True)
            checked += 1
        except SchemaNotFoundError:
            assert doc["kind"] in CRD_KINDS, f"no schema for {doc['kind']}"
    assert checked == 2  # Deployment and Service


def test_k8s_schema_validation_rejects_a_bad_manifest():
    validate = pytest.importorskip("kubernetes_validate")
    bad = _k8s("Deployment")
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/"
    with pytest.raises(validate.ValidationError):
        validate.validate(bad, validate.latest_version(), strict=True)


def test_deployment_probes_and_shutdown():
    deployment = _k8s("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000}
    assert container["command"] == SERVE
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in ("http", 8000), probe
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep = int(pre_stop[1])
    drain = int(_env(container)["FLASHBATCH_DRAIN_TIMEOUT"]["value"])
    assert pod["terminationGracePeriodSeconds"] > drain + sleep


def test_deployment_env_resources_and_security():
    deployment = _k8s("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _container()
    env = _env(container)
    for name in (
        "FLASHBATCH_HOST",
        "FLASHBATCH_PORT",
        "FLASHBATCH_API_KEY",
        "FLASHBATCH_TARGET",
        "FLASHBATCH_DRAFTER",
        "FLASHBATCH_DRAIN_TIMEOUT",
        "FLASHBATCH_MAX_NUM_SEQS",
    ):
        assert name in env, name
    assert env["FLASHBATCH_PORT"]["value"] == "8000"
    assert "secretKeyRef" in env["FLASHBATCH_API_KEY"]["valueFrom"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind]), kind
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == _dockerfile_uid() != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = _k8s("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http" and port["targetPort"] in ("http", 8000)


def test_service_monitor():
    monitor, service = _k8s("ServiceMonitor"), _k8s("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    # the job label is the Service name; the EngineDown alert selects it
    assert service["metadata"]["name"] == "flashbatch"


def test_prometheus_rule_resource():
    rule = _k8s("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"]
    for r in _rules(rule["spec"]["groups"]):
        assert {"alert", "expr"} <= set(r)


def test_scaled_object():
    scaled = _k8s("ScaledObject")
    deployment = _k8s("Deployment")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    assert target["name"] == deployment["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["query"] == "sum(flashbatch_num_requests_waiting)"
    assert meta["serverAddress"].startswith("http")
    for key, value in meta.items():
        assert isinstance(value, str), f"KEDA trigger metadata must be strings: {key}"
    assert float(meta["threshold"]) > 0


# ----------------------------------------------------------------------------- compose
def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _expand(text: str) -> str:
    """${VAR:-default} -> default (the files the stack uses when nothing is set)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def _mounts(service: dict) -> dict[str, Path]:
    """container path -> host path of the service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = _expand(volume).split(":")[:2]
        if source.startswith("."):
            mounts[target] = (DEPLOY / source).resolve()
    return mounts


def test_compose_references_existing_files():
    compose = _compose()
    assert set(compose["services"]) == {"engine", "prometheus", "grafana"}
    engine = compose["services"]["engine"]
    context = (DEPLOY / engine["build"]["context"]).resolve()
    assert context == ROOT, "the build context is the repository root"
    assert (context / engine["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert "8000:8000" in engine["ports"]
    grace = int(engine["stop_grace_period"].rstrip("s"))
    assert grace > int(engine["environment"]["FLASHBATCH_DRAIN_TIMEOUT"])
    for name, service in compose["services"].items():
        for target, source in _mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
    for config in ("prometheus.yml", "prometheus-host.yml"):  # PROMETHEUS_CONFIG choices
        assert (DEPLOY / "prometheus" / config).exists()


def test_compose_prometheus_and_grafana_wiring():
    services = _compose()["services"]
    prom = _mounts(services["prometheus"])
    assert prom["/etc/prometheus/prometheus.yml"] == DEPLOY / "prometheus" / "prometheus.yml"
    assert prom["/etc/prometheus/alerts.yml"] == ALERTS
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "flashbatch"]
    assert job["static_configs"][0]["targets"] == ["engine:8000"]
    assert job["scrape_interval"] == "5s"

    grafana = services["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = _mounts(grafana)
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert mounts["/etc/grafana/provisioning/datasources"] == provisioning / "datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == provisioning / "dashboards"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "provider.yml").read_text())
    (p,) = provider["providers"]
    dashboards_dir = mounts[p["options"]["path"]]
    assert dashboards_dir == DASHBOARD.parent
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == p["options"]["path"] + "/" + DASHBOARD.name


def test_compose_matches_the_compose_spec():
    pytest.importorskip("check_jsonschema")
    result = _run(
        sys.executable,
        "-m",
        "check_jsonschema",
        "--builtin-schema",
        "vendor.compose-spec",
        str(DEPLOY / "compose.yaml"),
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- Dockerfile
def _dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def _dockerfile_uid() -> int:
    (run,) = [r for k, r in _dockerfile() if k == "RUN" and "useradd" in r]
    return int(re.search(r"--uid (\d+)", run).group(1))


def test_dockerfile():
    instructions = _dockerfile()
    args = dict(r.split("=", 1) for k, r in instructions if k == "ARG" and "=" in r)
    bases = [r.split()[0] for k, r in instructions if k == "FROM"]
    assert {re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], b) for b in bases} == {
        "python:3.11-slim-bookworm"
    }
    runs = " ".join(r for k, r in instructions if k == "RUN")
    assert re.search(r"apt-get install -y --no-install-recommends libopenblas0-pthread", runs)
    users = [r for k, r in instructions if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert ("EXPOSE", "8000") in instructions
    assert json.loads(dict(instructions)["CMD"]) == SERVE
    (healthcheck,) = [r for k, r in instructions if k == "HEALTHCHECK"]
    command = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    assert command[:2] == ["python", "-c"] and "/health" in command[2]
    compile(command[2], "HEALTHCHECK", "exec")
    # the image runs as the user it creates
    (useradd,) = [r for k, r in instructions if k == "RUN" and "useradd" in r]
    assert re.search(r"useradd\b[^&]*\s(\S+)\s*$", useradd).group(1) == users[-1].split(":")[0]


def test_dockerfile_copies_what_pip_install_needs(tmp_path):
    """The image's `pip install .` finds every package the checkout's discovery finds.

    The build context is laid out as the Dockerfile's COPY lines (less the dockerignore'd
    paths) lay it, and setuptools' discovery runs on it with pyproject's own include/exclude.
    """
    import fnmatch
    import shutil

    from setuptools import find_packages

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()

    def ignored(directory: str, names: list[str]) -> set[str]:
        rel = Path(directory).relative_to(ROOT)
        return {
            n for n in names
            if any(fnmatch.fnmatch(str(rel / n), p.removeprefix("**/")) or
                   fnmatch.fnmatch(n, p.removeprefix("**/")) for p in ignore)
        }  # fmt: skip

    context = tmp_path / "context"
    context.mkdir()
    for keyword, rest in _dockerfile():
        if keyword == "COPY" and "--from" not in rest:
            *sources, dest = rest.split()
            for source in sources:
                # Docker: one source to a path without a trailing slash is copied *as* it.
                path = ROOT / source.rstrip("/")
                alone = len(sources) == 1 and not dest.endswith("/") and dest != "."
                target = context / dest if alone else context / dest / path.name
                if path.is_dir():
                    shutil.copytree(path, target, ignore=ignored, dirs_exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, target)

    def discovered(where: Path) -> set[str]:
        return set(find_packages(where, include=find["include"], exclude=find.get("exclude", ())))

    in_checkout = discovered(ROOT)
    assert {"engine", "drafters.lookup", "scheduler", "metrics"} <= in_checkout
    assert (context / "pyproject.toml").exists() and (
        context / pyproject["project"]["readme"]
    ).exists()
    missing = in_checkout - discovered(context)
    assert not missing, f"the image's pip install . would miss: {sorted(missing)}"


# ----------------------------------------------------------------------------- launchd
def test_launchd_plist():
    plist = plistlib.loads((DEPLOY / "launchd" / "ai.flashbatch.serve.plist").read_bytes())
    assert plist["Label"] == "ai.flashbatch.serve"
    program = plist["ProgramArguments"]
    assert program[0].endswith("/flashbatch") and program[1] == "serve"
    assert plist["RunAtLoad"] is True and plist["KeepAlive"]
    assert plist["StandardOutPath"].startswith("/") and plist["StandardErrorPath"].startswith("/")
    env = plist["EnvironmentVariables"]
    assert {"FLASHBATCH_HOST", "FLASHBATCH_PORT", "FLASHBATCH_DRAIN_TIMEOUT"} <= set(env)
    assert all(isinstance(v, str) for v in env.values())
    # launchd's SIGTERM -> SIGKILL wait (default 20 s) must cover the drain
    assert plist["ExitTimeOut"] > int(env["FLASHBATCH_DRAIN_TIMEOUT"])


# ----------------------------------------------------------------------------- README
def test_readme_documents_the_stack():
    readme = (DEPLOY / "README.md").read_text()
    for command in (
        "docker build -f deploy/Dockerfile",
        "docker compose -f deploy/compose.yaml up",
        "kubectl apply -k deploy/k8s",
        "launchctl bootstrap",
    ):
        assert command in readme, command
    for title in PANELS:
        assert title in readme, f"panel {title!r} not described in deploy/README.md"
    for alert in ALERT_NAMES:
        assert alert in readme, f"alert {alert} not described in deploy/README.md"


# ----------------------------------------------------------------------------- live
class _Exporter:
    """Serves an EngineMetrics registry on loopback while a thread keeps recording steps."""

    def __init__(self, metrics: EngineMetrics) -> None:
        body = metrics.exposition

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                data = body()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self.server.serve_forever, daemon=True),
            threading.Thread(target=self._record, args=(metrics,), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _record(self, metrics: EngineMetrics) -> None:
        from scheduler.plan import RowOutcome, StepResult

        i = 0
        while not self.stop.is_set():
            result = StepResult(
                outcomes={
                    "a": RowOutcome(tokens=[1, 2, 3], drafted=4, accepted=2),
                    "b": RowOutcome(tokens=[1], drafted=0, accepted=0),
                },
                batch_size=2,
                prefill_tokens=16,
                step_seconds=0.02,
                phase_seconds={"forward": 0.015, "commit": 0.005},
                kv_bytes=1 << 20,
                memory_active=1 << 28,
                memory_peak=1 << 29,
            )
            metrics.on_step(result, {"a": 4, "b": 0}, {"b": "policy"}, 1 << 22)
            metrics.on_queue(waiting=1, running=2)
            metrics.on_delta(3, 0.05)
            request = SimpleNamespace(
                finish_reason=("stop", "length", "abort", "error")[i % 4],
                arrival_time=0.0,
                admitted_time=0.1,
                first_token_time=0.3,
                finished_time=1.2,
                prompt_ids=[0] * 20,
                generated=40,
            )
            metrics.on_finish(request)
            i += 1
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_dashboard_queries_return_data_from_a_real_prometheus(tmp_path):
    """A real Prometheus scrapes the engine's metrics; every dashboard query, the variable
    queries and the KEDA query return series, with the labels their legends name."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip(prometheus_tool_absent("prometheus"))
    model = "probe-model"
    engine_metrics = EngineMetrics(model)
    HTTPMetrics(model, engine_metrics.registry).on_disconnect("stream")  # the server adds these
    exporter = _Exporter(engine_metrics)
    port = _free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "flashbatch",
                "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}/api/v1"

    def query(expr: str) -> list[dict]:
        answer = _get(f"{base}/query?" + urllib.parse.urlencode({"query": expr}))
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    try:
        deadline = time.monotonic() + 60
        while True:  # until 3 scrapes are in
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            try:
                samples = query("count_over_time(flashbatch_num_requests_running[1m])")
                if samples and float(samples[0]["value"][1]) >= 3:
                    break
            except OSError:
                pass
            time.sleep(0.5)

        for title, target in _dashboard_targets():
            expr = _grafana_to_promql(target["expr"], model=model)
            result = query(expr)
            assert result, f"{title}: no data for {expr}"
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                for series in result:
                    assert label in series["metric"], f"{title}: no label {label} in {expr}"
        for variable in _dashboard()["templating"]["list"]:
            if variable["type"] == "query":
                match, label = re.fullmatch(
                    r"label_values\((.+), (\w+)\)", variable["definition"]
                ).groups()
                match = _grafana_to_promql(match, model=model)
                answer = _get(
                    f"{base}/label/{label}/values?" + urllib.parse.urlencode({"match[]": match})
                )
                assert answer["data"], f"variable {variable['name']}: no values"
        for expr in _promql_sources()["ScaledObject"]:
            assert query(expr), expr
        # every finished_reason the recorder produced is there to split by
        reasons = {
            s["metric"]["finished_reason"]
            for s in query("sum by (finished_reason) (flashbatch_request_success_total)")
        }
        assert {"stop", "length", "abort", "error"} <= reasons
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        exporter.close()


def test_endpoint_picker_example_names_exported_metrics():
    """The Gateway API Inference Extension example points the endpoint picker at metric
    names this engine exports (a renamed metric would silently blind the router)."""
    text = (ROOT / "deploy" / "gateway-inference-extension" / "endpoint-picker.yaml").read_text()
    flags = dict(re.findall(r"--([a-z-]+-metric)=(flashbatch_\w+)", text))
    assert set(flags) == {"total-queued-requests-metric", "total-running-requests-metric",
                          "kv-cache-usage-percentage-metric"}  # fmt: skip
    assert not set(flags.values()) - set(METRIC_NAMES), flags
    config = yaml.safe_load(text)
    assert config["kind"] == "EndpointPickerConfig"
    assert "prefix-cache-scorer" in {p["type"] for p in config["plugins"]}
