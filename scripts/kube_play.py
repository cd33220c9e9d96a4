#!/usr/bin/env python3
"""Turn a rendered overlay (kustomize's YAML on stdin) into what `podman kube play` runs on
one host, YAML on stdout. scripts/kube_smoke.sh uses it; the changes are only what a single
podman host lacks:

- kinds podman has no use for are left out (Namespace, Service, HPA, PDB, KEDA's
  ScaledObject), and so are Deployments at zero replicas (KEDA would start them);
- the StatefulSet becomes a Deployment with its claim as a PersistentVolumeClaim (a podman
  volume);
- every pod shares the host's network on the given loopback ports (no Services, no pod IPs,
  no cluster DNS): Redis and the gateway on theirs, workers on free ones, one pod each;
- what podman 4 does not read is dropped or inlined: probes (the smoke test checks
  readiness itself), emptyDir volumes (the image's own directory serves), Secrets (their
  values become the containers' environment, as `envFrom` would make them).

    kubectl kustomize deploy/k8s/overlays/cpu | scripts/kube_play.py --port 8000 --redis-port 6379
"""

from __future__ import annotations

import argparse
import base64
import secrets
import sys
from typing import Any

import yaml

DROPPED_KINDS = {"Namespace", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                 "ScaledObject"}
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
#: how the shipped Secret's placeholders begin (common/settings.py PLACEHOLDER_SECRET)
PLACEHOLDER_SECRET = "replace-me"


def for_podman(docs: list[dict[str, Any]], port: int, redis_port: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    secrets = {doc["metadata"]["name"]: secret_values(doc) for doc in docs
               if doc["kind"] == "Secret"}
    for doc in docs:
        kind = doc["kind"]
        if kind in DROPPED_KINDS or kind == "Secret":
            continue
        if kind == "ConfigMap" and "SPEECH_REDIS_URL" in doc.get("data", {}):
            doc["data"]["SPEECH_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
        if kind == "StatefulSet":
            out += [claim_of(template, doc) for template in doc["spec"].pop("volumeClaimTemplates")]
            doc = as_deployment(doc)
        if doc["kind"] == "Deployment":
            if doc["spec"].get("replicas", 1) == 0:
                continue
            doc["spec"]["replicas"] = 1  # one pod per Deployment: they share the host's ports
            pod = doc["spec"]["template"]["spec"]
            on_host(pod, doc["metadata"]["name"], port, redis_port)
            for container in pod["containers"]:
                inline_secrets(container, secrets)
        out.append(doc)
    return out


def secret_values(doc: dict[str, Any]) -> dict[str, str]:
    """The Secret's values, its shipped placeholders (which every process refuses: common/
    settings.py) each replaced by a random secret for this one run."""
    values = {key: base64.b64decode(value).decode() for key, value in doc.get("data", {}).items()}
    values.update((key, str(value)) for key, value in doc.get("stringData", {}).items())
    return {key: secrets.token_hex(32) if value.startswith(PLACEHOLDER_SECRET) else value
            for key, value in values.items()}


def inline_secrets(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> None:
    sources = container.get("envFrom", [])
    container["envFrom"] = [source for source in sources if "secretRef" not in source]
    given = {item["name"] for item in container.get("env", [])}
    for source in sources:
        if "secretRef" in source:
            container["env"] = [*container.get("env", []), *(
                {"name": key, "value": value}
                for key, value in secrets[source["secretRef"]["name"]].items()
                if key not in given)]


def claim_of(template: dict[str, Any], statefulset: dict[str, Any]) -> dict[str, Any]:
    name = f"{template['metadata']['name']}-{statefulset['metadata']['name']}-0"
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name}, "spec": template["spec"]}


def as_deployment(statefulset: dict[str, Any]) -> dict[str, Any]:
    spec = statefulset["spec"]
    pod = spec["template"]["spec"]
    pod["volumes"] = [*pod.get("volumes", []),
                      *({"name": mount["name"], "persistentVolumeClaim": {
                          "claimName": f"{mount['name']}-{statefulset['metadata']['name']}-0"}}
                        for c in pod["containers"] for mount in c.get("volumeMounts", [])
                        if mount["name"] not in {v["name"] for v in pod.get("volumes", [])})]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": statefulset["metadata"],
            "spec": {"replicas": 1, "selector": spec["selector"], "template": spec["template"]}}


def on_host(pod: dict[str, Any], name: str, port: int, redis_port: int) -> None:
    pod["hostNetwork"] = True
    empty = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    pod["volumes"] = [v for v in pod.get("volumes", []) if v["name"] not in empty]
    for container in pod["containers"]:
        for probe in PROBES:
            container.pop(probe, None)
        container.pop("ports", None)
        container["volumeMounts"] = [m for m in container.get("volumeMounts", [])
                                     if m["name"] not in empty]
        command = container.get("command", [])
        if command[:1] == ["redis-server"]:
            command[command.index("--bind") + 1] = "127.0.0.1"
            command[command.index("--port") + 1] = str(redis_port)
            if "--requirepass" in command:  # the cluster's password; none on this host
                at = command.index("--requirepass")
                del command[at:at + 2]
            container.pop("env", None)
        if "gateway" in command:
            command[command.index("--host") + 1] = "127.0.0.1"
            command[command.index("--port") + 1] = str(port)
        for item in container.get("env", []):
            if item["name"] == "SPEECH_WORKER_HOST":
                item.pop("valueFrom", None)
                item["value"] = "127.0.0.1"
            elif item["name"] == "SPEECH_WORKER_PORT":
                item["value"] = "0"  # a free port, published in the worker's heartbeat
            elif item["name"] == "SPEECH_CONSUMER":
                item.pop("valueFrom", None)
                item["value"] = name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the gateway's port")
    parser.add_argument("--redis-port", type=int, required=True)
    args = parser.parse_args()
    docs = [doc for doc in yaml.safe_load_all(sys.stdin) if doc]
    yaml.safe_dump_all(for_podman(docs, args.port, args.redis_port), sys.stdout,
                       sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
