"""deploy/ (Kubernetes) agrees with the code: the commands parse with the real argument parsers,
ports and probes are the code's defaults, every engine replica is reachable by the gateway."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.rpc.defaults import GATEWAY_PORT, LIVENESS_SERVICE
from engine_svc.server.health import HEALTH_NAMES
from engine_svc.server.main import build_parser as engine_parser
from gateway.cli import build_parser as gateway_parser
from gateway.client import LLMServeClient
from gateway.replica_options import read_engines_file
from tests.fault_helpers import wait_for
from tests.replica_helpers import free_port

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
ENGINE_PORT = engine_parser().get_default("port")


def documents() -> list[dict]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = documents()


def of_kind(kind: str, component: str | None = None) -> list[dict]:
    return [
        d
        for d in DOCS
        if d["kind"] == kind
        and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def port_number(c: dict, port) -> int:
    """A probe or Service port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def mounted_at(deployment: dict, path: str) -> dict:
    """The volume whose mount holds ``path``."""
    spec = deployment["spec"]["template"]["spec"]
    mount = next(m for m in container(deployment)["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    return next(v for v in spec["volumes"] if v["name"] == mount["name"])


ENGINES = of_kind("Deployment", "engine")
(GATEWAY,) = of_kind("Deployment", "gateway")


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    manifests = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


def test_every_object_is_well_formed():
    for d in DOCS:
        assert d["apiVersion"] and d["kind"] and d["metadata"]["name"], d
    names = [(d["kind"], d["metadata"]["name"]) for d in DOCS]
    assert len(names) == len(set(names))
    for dep in of_kind("Deployment"):
        assert selects(dep["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("dep", ENGINES, ids=lambda d: d["metadata"]["name"])
def test_engine_replica_runs_the_engine_server_on_its_default_port(dep):
    assert len(ENGINES) >= 2
    assert dep["spec"]["replicas"] == 1  # one pod per replica: it owns a device and a KV pool
    c = container(dep)
    assert c["command"][1:] == ["-m", "engine_svc.server"]
    args = engine_parser().parse_args(c["args"])
    assert args.host == "0.0.0.0" and args.port == ENGINE_PORT and not args.socket
    (port,) = c["ports"]
    assert port["containerPort"] == ENGINE_PORT
    # grpc.health.v1 on the engine port, for a name the engine serves (k8s grpc probes take a
    # number only, and no TLS: the probe is plaintext like the engine's args here).
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(c[probe]) - {"periodSeconds", "failureThreshold", "timeoutSeconds"} == {"grpc"}, probe
        assert c[probe]["grpc"]["port"] == ENGINE_PORT, probe
        assert c[probe]["grpc"].get("service", "") in HEALTH_NAMES, probe
    assert not args.tls_cert
    assert "persistentVolumeClaim" in mounted_at(dep, args.model)


def test_each_engine_replica_has_its_own_service_and_the_gateway_names_them_all(tmp_path):
    services = of_kind("Service", "engine")
    pods = [(d, d["spec"]["template"]["metadata"]["labels"]) for d in ENGINES]
    addresses = []
    for svc in services:
        chosen = [d for d, labels in pods if selects(svc["spec"]["selector"], labels)]
        assert len(chosen) == 1, f"{svc['metadata']['name']} must select exactly one replica"
        (p,) = svc["spec"]["ports"]
        assert p["port"] == ENGINE_PORT
        assert port_number(container(chosen[0]), p["targetPort"]) == ENGINE_PORT
        addresses.append(f"{svc['metadata']['name']}:{p['port']}")
    assert len(services) == len(ENGINES)

    args = gateway_parser().parse_args(container(GATEWAY)["args"])
    volume = mounted_at(GATEWAY, args.engines_file)
    (cm,) = [d for d in of_kind("ConfigMap") if d["metadata"]["name"] == volume["configMap"]["name"]]
    engines_txt = cm["data"][Path(args.engines_file).name]
    (tmp_path / "engines.txt").write_text(engines_txt)
    assert read_engines_file(tmp_path / "engines.txt") == addresses


def test_gateway_serves_on_the_default_port_with_grpc_health_probes():
    c = container(GATEWAY)
    assert c["command"][1:] == ["-m", "gateway"]
    args = gateway_parser().parse_args(c["args"])
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == GATEWAY_PORT
    assert not args.engine and args.replicas == 1  # it starts no engine: the replicas are pods
    (port,) = c["ports"]
    assert port["containerPort"] == GATEWAY_PORT
    ready, live = c["readinessProbe"]["grpc"], c["livenessProbe"]["grpc"]
    assert port_number(c, ready["port"]) == GATEWAY_PORT and ready.get("service", "") == ""
    assert port_number(c, live["port"]) == GATEWAY_PORT and live["service"] == LIVENESS_SERVICE
    grace = GATEWAY["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.drain_grace_s  # the drain finishes before the kubelet's SIGKILL
    assert "persistentVolumeClaim" in mounted_at(GATEWAY, args.model)

    (svc,) = of_kind("Service", "gateway")
    assert selects(svc["spec"]["selector"], GATEWAY["spec"]["template"]["metadata"]["labels"])
    (p,) = svc["spec"]["ports"]
    assert p["port"] == GATEWAY_PORT and port_number(c, p["targetPort"]) == GATEWAY_PORT


def test_the_image_holds_the_interpreter_the_manifests_run():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", dockerfile, re.M)
    for dep in [*ENGINES, GATEWAY]:
        c = container(dep)
        assert c["command"][0] == f"{workdir}/.venv/bin/python"
        assert c["image"] == ENGINES[0]["spec"]["template"]["spec"]["containers"][0]["image"]


def test_the_gateway_answers_its_liveness_probe_without_engines(default_model_dir):
    """The probe the manifest names exists: SERVING while no engine is reachable (readiness is not)."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--model", str(default_model_dir)]
    cmd += ["--port", str(port), "--engine", f"127.0.0.1:{free_port()}", "--tokenizer-workers", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with LLMServeClient(f"127.0.0.1:{port}", timeout=5) as client:

            def alive() -> bool:
                try:
                    return client.health_status(LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:  # not listening yet
                    return False

            wait_for(alive, 60, "the liveness service SERVING", every_s=0.2)
            assert client.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_an_engine_started_as_the_manifest_says_answers_its_probes(tiny_llama):
    """The probes' services exist: SERVING on the engine port once the engine is warm."""
    c = container(ENGINES[0])
    port = free_port()
    # The pod's arguments, with a test model, a loopback host and a free port in place of the pod's.
    override = {"--model": str(tiny_llama), "--host": "127.0.0.1", "--port": str(port)}
    args = list(c["args"])
    for i, flag in enumerate(args[:-1]):
        if flag in override:
            args[i + 1] = override[flag]
    cmd = [sys.executable, *c["command"][1:], *args, "--num-kv-blocks", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    services = {c[p]["grpc"].get("service", "") for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            def serving() -> bool:
                assert proc.poll() is None, f"the engine exited {proc.returncode}"
                try:
                    return status("") == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:  # not listening yet
                    return False

            wait_for(serving, 120, "the engine's health SERVING", every_s=0.2)
            for service in services:
                assert status(service) == health_pb2.HealthCheckResponse.SERVING, service
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
