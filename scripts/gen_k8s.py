"""The Kubernetes manifests that follow from the backend table: one worker Deployment and one
KEDA ScaledObject per backend (deploy/k8s/base/workers.yaml), the CPU overlay's patch that
takes their GPUs away (deploy/k8s/overlays/cpu/workers-cpu.yaml), and the no-KEDA
component's patch that deletes the ScaledObjects and gives each Deployment the table's
replica count (deploy/k8s/components/no-keda/no-keda.yaml).

scripts/gen_deploy.py writes them with the other generated files (and --check compares
them). The hand-written manifests beside them (Redis, the gateway, settings, the Secret, the
kustomizations) name no backend.

Standard library only: the YAML is written by `dump` below (a string is plain where YAML
reads it back as that string, else in JSON's quotes, which YAML reads too).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from common import keys
from common.backends import BACKENDS, WORKER_PROCESS_ENV, Backend

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "deploy" / "k8s" / "base" / "workers.yaml"
CPU_PATCH = ROOT / "deploy" / "k8s" / "overlays" / "cpu" / "workers-cpu.yaml"
NO_KEDA_PATCH = ROOT / "deploy" / "k8s" / "components" / "no-keda" / "no-keda.yaml"

HEADER = ("# Generated from common/backends.py by scripts/gen_deploy.py: edit the table (or the\n"
          "# generator, scripts/gen_k8s.py), not this file.\n")
APP = "speech-gateway"
#: the port a worker serves its direct endpoints on (SPEECH_WORKER_PORT); its Service-less
#: pods advertise http://POD_IP:PORT in their heartbeat, which the smoke test calls
WORKER_PORT = 8100
#: seconds a stopping worker gets before SIGKILL: above SPEECH_STOP_GRACE_SECONDS (20), so
#: it finishes its task or leaves it pending for redelivery (as supervisord's stopwaitsecs)
WORKER_TERMINATION_SECONDS = 40
#: KEDA: how long every trigger must be idle before the last replica goes. Longer than the
#: idle unload (120 s): the model is unloaded first, so a pod waits cold only briefly
COOLDOWN_SECONDS = 300
MAX_REPLICAS = 4
#: on the CPU overlay, the worker's memory cap is this far under its pod's limit (the
#: interpreter's own and a decode's transient memory, which the cap's check comes after)
CPU_CAP_HEADROOM_MIB = 768
#: queued (undelivered) entries per replica before KEDA adds one
LAG_PER_REPLICA = 5
#: how KEDA's operator reaches Redis, from the scale target's environment (the ConfigMap
#: and the Secret): its host:port, and its password (Settings.redis_password; "" = none)
KEDA_ADDRESS_ENV = "REDIS_ADDRESS"
KEDA_PASSWORD_ENV = "SPEECH_REDIS_PASSWORD"
#: what KEDA reads only from a trigger's own metadata: the database index and TLS, as the
#: base's SPEECH_REDIS_URL (redis://…/0). deploy/k8s/base/kustomization.yaml (and each
#: overlay that points elsewhere) copies the ConfigMap's REDIS_DATABASE_INDEX and
#: REDIS_ENABLE_TLS over these with kustomize `replacements`
KEDA_DATABASE_INDEX = "0"
KEDA_ENABLE_TLS = "false"
#: what a worker's pod asks of a node per environment (the engine's weights on the GPU are
#: on top of the process); the limit is twice the request
ENV_MEMORY_MIB = {"core": 2048, "hf": 6144, "nemo": 6144, "xtts": 6144, "voiceprint": 1024}


def worker_name(row: Backend) -> str:
    return f"{APP}-worker-{row.name}"


def labels(row: Backend) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "worker",
            f"{APP}/backend": row.name}


def pod_memory_mib(row: Backend) -> int:
    """A worker pod's memory request (its limit is twice that)."""
    memory = ENV_MEMORY_MIB.get(row.env, 4096)
    if row.memory_cap_mib:  # the worker's own cap on its process, plus room for the rest
        memory = max(memory, row.memory_cap_mib + 512)
    return memory


def worker_deployment(row: Backend) -> dict[str, object]:
    memory = pod_memory_mib(row)
    env = [
        {"name": "SPEECH_BACKEND", "value": row.name},
        # a GPU pod without CUDA does not start (workers/engine_host.NoCuda) rather than
        # hold its GPU and run on the CPU; the cpu overlay patches this to "cpu"
        {"name": "SPEECH_DEVICE", "value": "cuda" if row.device == "auto" else row.device},
        {"name": "SPEECH_MEMORY_CAP_MIB", "value": str(row.memory_cap_mib)},
        # a failed load takes a fresh image in place: an exit here is a container restart,
        # whose growing back-off would keep the worker's other models away for minutes
        {"name": "SPEECH_LOAD_FAILURE", "value": "reexec"},
        {"name": "SPEECH_IDLE_UNLOAD_SECONDS", "value": str(row.idle_unload_seconds)},
        {"name": "SPEECH_CONSUMER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "SPEECH_WORKER_HOST",
         "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "SPEECH_WORKER_PORT", "value": str(WORKER_PORT)},
        *({"name": name, "value": value} for name, value in WORKER_PROCESS_ENV.items()),
    ]
    # /live needs no secret and answers only while the worker's event loop runs
    probe = {"httpGet": {"path": "/live", "port": "worker"}, "periodSeconds": 10}
    container = {
        "name": "worker",
        "image": APP,
        "command": [f"/app/.venvs/{row.env}/bin/python", "-m", "workers"],
        "env": env,
        "envFrom": [{"configMapRef": {"name": f"{APP}-settings"}},
                    {"secretRef": {"name": f"{APP}-secrets"}}],
        "ports": [{"name": "worker", "containerPort": WORKER_PORT}],
        "readinessProbe": probe,
        # loading a large model on the first task can take minutes: /live answers before that
        "startupProbe": {**probe, "failureThreshold": 30},
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": {
            "requests": {"cpu": "1", "memory": f"{memory}Mi"},
            "limits": {"memory": f"{memory * 2}Mi", "nvidia.com/gpu": 1},
        },
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": worker_name(row), "labels": labels(row)},
        "spec": {
            # no `replicas`: KEDA sets the count (0 while the backend's streams are empty),
            # and a count here would undo its scaling on every `kubectl apply`. Without KEDA,
            # components/no-keda sets the table's count (`no_keda_replicas`)
            "selector": {"matchLabels": labels(row)},
            # a new pod takes the old one's GPU: a surge pod would wait for a spare GPU, and
            # the rollout with it (the tasks wait in Redis meanwhile, and are not lost)
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels(row)},
                "spec": {
                    "terminationGracePeriodSeconds": WORKER_TERMINATION_SECONDS,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                        "fsGroup": 1000,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [
                        {"name": "models",
                         "persistentVolumeClaim": {"claimName": f"{APP}-models"}},
                    ],
                },
            },
        },
    }


def scaled_object(row: Backend) -> dict[str, object]:
    """Scale on both lanes' streams: lag (entries no worker took yet, the one measure that
    can wake a backend from zero) and pending entries (taken, not yet acknowledged: a task
    running keeps its worker up past the cooldown); and on the tasks waiting in the keys'
    lines (SPEECH_QUEUED_PER_KEY, common/store/shares.py), which have no entry yet: one
    key's flood is mostly there (KEDA scales to the largest of the triggers' counts, so
    the lines wake and grow the backend as lag does, not added to it)."""
    reach = {"addressFromEnv": KEDA_ADDRESS_ENV, "passwordFromEnv": KEDA_PASSWORD_ENV,
             "databaseIndex": KEDA_DATABASE_INDEX, "enableTLS": KEDA_ENABLE_TLS}
    triggers: list[dict[str, object]] = []
    for lane in keys.LANES:
        common = {**reach, "stream": keys.queue(row.name, lane),
                  "consumerGroup": keys.WORKER_GROUP}
        triggers.append({"type": "redis-streams", "name": f"{lane}-lag",
                         "metadata": {**common, "lagCount": str(LAG_PER_REPLICA),
                                      "activationLagCount": "0"}})
        triggers.append({"type": "redis-streams", "name": f"{lane}-pending",
                         "metadata": {**common, "pendingEntriesCount": "1"}})
    triggers.append({"type": "redis", "name": "lines",
                     "metadata": {**reach, "listName": keys.lines(row.name),
                                  "listLength": str(LAG_PER_REPLICA),
                                  "activationListLength": "0"}})
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": worker_name(row), "labels": labels(row)},
        "spec": {
            "scaleTargetRef": {"name": worker_name(row)},
            "minReplicaCount": 0,
            "maxReplicaCount": max(MAX_REPLICAS, row.replicas),
            "pollingInterval": 10,
            "cooldownPeriod": COOLDOWN_SECONDS,
            "triggers": triggers,
        },
    }


def cpu_patch(row: Backend) -> dict[str, object]:
    """A strategic-merge patch: the worker on CPU, with no GPU asked for, a memory cap under
    its pod's limit, and no models
    claim (the demo serves the bundled tiny.en; a 100 GiB ReadWriteMany claim stays Pending
    on a single-node cluster's local-path storage, and its pods with it): an empty dir."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": worker_name(row)},
        "spec": {"template": {"spec": {
            "containers": [{
                "name": "worker",
                "env": [{"name": "SPEECH_DEVICE", "value": "cpu"},
                        # on CPU the model lives in the pod's memory: a cap under its limit
                        # refuses a file too large with a clear error (out_of_memory) where
                        # the kernel's OOM killer would end the pod mid-task
                        {"name": "SPEECH_MEMORY_CAP_MIB",
                         "value": str(2 * pod_memory_mib(row) - CPU_CAP_HEADROOM_MIB)}],
                "resources": {"limits": {"nvidia.com/gpu": None}},
            }],
            "volumes": [{"name": "models", "persistentVolumeClaim": None, "emptyDir": {}}],
        }}},
    }


def no_keda_replicas(row: Backend) -> int:
    """A worker's fixed count where no KEDA scales it: enabled rows their replicas, others 0."""
    return row.replicas if row.enabled else 0


def no_keda_patches(row: Backend) -> list[dict[str, object]]:
    """Strategic-merge patches for a cluster without KEDA: the Deployment at the table's
    count. (The ScaledObjects, whose kind the API server would refuse, are deleted by one
    patch in components/no-keda/kustomization.yaml: kustomize 5.5, kubectl 1.32's, panics on
    a delete among a multi-document patch file's documents.)"""
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": worker_name(row)},
         "spec": {"replicas": no_keda_replicas(row)}},
    ]


def dump(value: object, indent: int = 0) -> str:
    """`value` (dicts, lists, strings, numbers, booleans, None) as block-style YAML."""
    pad = " " * indent
    if isinstance(value, dict) and value:
        lines = []
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{key}:\n{dump(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {scalar(item)}")
        return "\n".join(lines)
    if isinstance(value, list) and value:
        lines = []
        for item in value:
            text = dump(item, indent + 2) if isinstance(item, dict | list) and item else None
            lines.append(f"{pad}- {text.lstrip()}" if text else f"{pad}- {scalar(item)}")
        return "\n".join(lines)
    return pad + scalar(value)


def scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict | list):
        return "{}" if isinstance(value, dict) else "[]"
    text = str(value)
    if PLAIN.fullmatch(text) and text.lower() not in YAML_WORDS:
        return text
    return json.dumps(text)


#: strings YAML reads as themselves when unquoted (no number, boolean or null among them)
PLAIN = re.compile(r"[A-Za-z_/.][A-Za-z0-9_/.-]*")
YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~"}


def documents(docs: list[dict[str, object]]) -> str:
    return HEADER + "".join(f"---\n{dump(doc)}\n" for doc in docs)


def generated() -> dict[Path, str]:
    rows = list(BACKENDS.values())
    return {
        WORKERS: documents([doc for row in rows
                            for doc in (worker_deployment(row), scaled_object(row))]),
        CPU_PATCH: documents([cpu_patch(row) for row in rows]),
        NO_KEDA_PATCH: documents([doc for row in rows for doc in no_keda_patches(row)]),
    }
