"""The Kubernetes manifests (deploy/kubernetes, kustomize) render, hang together, and use flags
`nbos` accepts: the gateway's RBAC lets its host provider manage daemon Pods, every Secret and
ConfigMap a Pod mounts is the one the guide says to create or the kustomization generates, and
the daemon Pod template asks for a GPU, names itself after its Pod and mounts the shared
workspace (a ReadWriteMany claim) at the path the gateway exports."""

import json
import os
import re
import shutil
import subprocess
import tempfile

import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
GUIDE_SECRETS = {"nbos-cluster-credential", "nbos-token", "nbos-s3"}


def render():
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl missing: run `make bootstrap`"
    out = subprocess.run([kubectl, "kustomize", os.path.join(ROOT, "deploy", "kubernetes")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def test_the_manifests_render_and_hang_together():
    docs = render()
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim",
            "Deployment", "Service", "NetworkPolicy", "ConfigMap"} <= kinds, kinds
    assert all(d["metadata"].get("namespace") == "nbos" for d in docs if d["kind"] != "Namespace")

    role = by_kind(docs, "Role")[0]
    verbs = {v for r in role["rules"] if "pods" in r["resources"] for v in r["verbs"]}
    assert {"list", "create", "delete"} <= verbs, verbs
    gateway = by_kind(docs, "Deployment")[0]
    spec = gateway["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == role["metadata"]["name"]
    assert gateway["spec"]["replicas"] == 1 and gateway["spec"]["strategy"]["type"] == "Recreate"

    # What the gateway mounts exists: generated ConfigMaps, or Secrets the guide creates.
    config_maps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    claims = {d["metadata"]["name"] for d in by_kind(docs, "PersistentVolumeClaim")}
    for v in spec["volumes"]:
        if "configMap" in v:
            assert v["configMap"]["name"] in config_maps, v
        if "secret" in v:
            assert v["secret"]["secretName"] in GUIDE_SECRETS, v
        if "persistentVolumeClaim" in v:
            assert v["persistentVolumeClaim"]["claimName"] in claims, v
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    args = dict(a[2:].split("=", 1) for a in spec["containers"][0]["args"] if "=" in a)
    for flag in ("credential", "kubernetes-pod-template", "state-dir"):
        assert any(args[flag].startswith(m) for m in mounts), (flag, args[flag], mounts)

    # The daemon Pod template the provider creates Pods from.
    template = json.loads(next(iter(config_maps.values()))["data"]["daemon-pod.json"])
    assert template["kind"] == "Pod"
    daemon = template["spec"]["containers"][0]
    assert daemon["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert "--server-id=$(POD_NAME)" in daemon["args"]
    env = {e["name"] for e in daemon["env"]}
    for var in re.findall(r"\$\((\w+)\)", " ".join(daemon["args"])):
        assert var in env, var
    for v in template["spec"]["volumes"]:
        if "secret" in v:
            assert v["secret"]["secretName"] in GUIDE_SECRETS, v
    # The workspace: one ReadWriteMany claim, mounted by every daemon where the gateway says.
    workspace = next(v for v in template["spec"]["volumes"] if v["name"] == "workspace")
    claim = next(d for d in by_kind(docs, "PersistentVolumeClaim")
                 if d["metadata"]["name"] == workspace["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], claim
    root = args["workspace-root"]
    assert f"--workspace-root={root}" in daemon["args"]
    assert {"name": "workspace", "mountPath": root} in daemon["volumeMounts"]
    for e in daemon["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] in GUIDE_SECRETS, ref


def test_nbos_accepts_the_gateways_arguments():
    """The gateway's args, with local paths, get past flag parsing to the Kubernetes API lookup
    (which fails outside a Pod)."""
    docs = render()
    container = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    template = json.loads(by_kind(docs, "ConfigMap")[0]["data"]["daemon-pod.json"])
    work = tempfile.mkdtemp(prefix="nbos-k8s-")
    try:
        nbos = os.environ.get("NBOS_BIN", os.path.join(ROOT, "build", "bin", "nbos"))
        subprocess.run([nbos, "credential", "create", f"{work}/cluster.credential"], check=True,
                       capture_output=True)
        with open(f"{work}/daemon-pod.json", "w") as f:
            json.dump(template, f)
        local = {"--credential": f"{work}/cluster.credential", "--state-dir": f"{work}/state",
                 "--kubernetes-pod-template": f"{work}/daemon-pod.json", "--port": "0",
                 "--control-address": "127.0.0.1:0", "--address": "127.0.0.1"}
        args = []
        for a in container["args"][1:]:
            flag = a.split("=", 1)[0]
            args.append(f"{flag}={local[flag]}" if flag in local else a)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        out = subprocess.run([nbos, "gateway", *args, "--token", "t"], capture_output=True,
                             text=True, timeout=60, env=env)
        assert out.returncode == 2, out
        assert "KUBERNETES_SERVICE_HOST" in out.stderr, out.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)
