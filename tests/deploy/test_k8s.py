"""docker/k8s: the Kubernetes manifests, validated offline against the Kubernetes schemas
(`kubernetes-validate` bundles them, strict mode rejects unknown fields) and checked against each
other and the server's configuration: probes on the gRPC port, the termination grace longer than
preStop + drain grace, a headless Service for per-pod routing, the PDB / HPA / ServiceMonitor aimed at
the Deployment. The ServiceMonitor is a Prometheus Operator CRD, outside those schemas: it is checked
structurally against the Service it selects.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import kubernetes_validate  # a test dependency ([test] extra); its schemas ship inside the wheel
import pytest
import yaml

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.config import ServerConfig

K8S = Path(__file__).resolve().parents[2] / "docker" / "k8s"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ReTopKService"].full_name
# ServerConfig's defaults, read without constructing one (construction also loads the method registry)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
KUBERNETES_VERSION = "1.33.0"  # the oldest release whose schemas have every field used (preStop sleep: 1.30)


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def resources() -> dict[str, dict]:
    """kind -> the manifest (one resource per file)."""
    out = {}
    for name in kustomization()["resources"]:
        docs = list(yaml.safe_load_all((K8S / name).read_text()))
        assert len(docs) == 1, f"{name}: one resource per file"
        out[docs[0]["kind"]] = docs[0]
    return out


def test_kustomization_lists_every_manifest_and_only_existing_ones():
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize("kind", ["Namespace", "Deployment", "Service", "PodDisruptionBudget",
                                  "HorizontalPodAutoscaler", "PersistentVolumeClaim"])
def test_manifest_validates_against_the_kubernetes_schema(kind):
    kubernetes_validate.validate(resources()[kind], KUBERNETES_VERSION, strict=True)


def test_the_validation_rejects_a_misspelt_probe_field():
    """The check above can fail: strict validation refuses a field the schema does not have."""
    bad = copy.deepcopy(resources()["Deployment"])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def container() -> dict:
    return resources()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"]}


def test_probes_use_grpc_health_on_the_grpc_port():
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"grpc": DEFAULTS["port"], "metrics": DEFAULTS["metrics_port"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container()[probe]["grpc"]["port"] == DEFAULTS["port"], probe
    # readiness asks for the service itself, NOT_SERVING from the first moment of a drain
    assert container()["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    # liveness asks for "" (service/health.py): the engine alive, SERVING while a drain finishes
    assert "service" not in container()["livenessProbe"]["grpc"]


def test_termination_grace_outlasts_prestop_plus_the_servers_drain_grace():
    pod = resources()["Deployment"]["spec"]["template"]["spec"]
    drain = float(env().get("RETOPK_DRAIN_GRACE_S", DEFAULTS["drain_grace_s"]))
    pre_stop = container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert drain >= 0 and pre_stop > 0
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain


def test_service_pdb_hpa_and_servicemonitor_point_at_the_deployment():
    r = resources()
    pod_labels = r["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selects = lambda selector: all(pod_labels.get(k) == v for k, v in selector.items())  # noqa: E731
    assert r["Deployment"]["spec"]["selector"]["matchLabels"] == pod_labels
    service = r["Service"]
    assert service["spec"]["clusterIP"] == "None"  # headless: routers see every pod
    assert selects(service["spec"]["selector"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {p["name"] for p in container()["ports"]}
    assert selects(r["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"])
    target = r["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", r["Deployment"]["metadata"]["name"])
    [metric] = r["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "retopk_requests_waiting"  # retopk_server.metrics
    monitor = r["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert all(service["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_kustomize_image_names_the_container_image():
    [image] = kustomization()["images"]
    assert image["name"] == container()["image"]


def test_the_session_dir_is_the_shared_persistent_volume():
    """Issue 33: RETOPK_SESSION_DIR lies on a volume of the retopk-sessions claim, which every pod can mount
    (ReadWriteMany), so a session saved by a draining pod is loaded by whichever pod its next call reaches."""
    pod = resources()["Deployment"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    volume = mounts[env()["RETOPK_SESSION_DIR"]]
    claim = next(v for v in pod["volumes"] if v["name"] == volume)["persistentVolumeClaim"]["claimName"]
    pvc = resources()["PersistentVolumeClaim"]
    assert claim == pvc["metadata"]["name"] and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
