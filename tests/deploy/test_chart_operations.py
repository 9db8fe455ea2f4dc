"""The chart's operations features, rendered by the real Helm engine (test_chart.py validates
the same configurations against the Kubernetes schemas and lints them): weights downloaded from
the Hugging Face Hub into a shared volume, worker pod extras, several workers per GPU pod, the
engine liveness probe (its command run here against real worker endpoints), a read-only root
filesystem everywhere, the PodMonitor / PrometheusRule / dashboard objects and the router HPA."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from test_chart import CONFIGS, FULL, find, one, pod_templates, pools_args, render, router_args

helm = pytest.importorskip("helm_python")
CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "v4serve"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as c:
        yield c


def workers(docs) -> dict[str, dict]:
    """The worker groups' pod templates by role."""
    rc = one(docs, "RayCluster", FULL)
    return {g["groupName"]: g["template"] for g in rc["spec"]["workerGroupSpecs"]}


def test_hf_weights_downloaded_once_into_a_shared_volume(chart):
    docs = render(chart, CONFIGS["hf weights"])
    model_dir = "/models/hf/deepseek-ai/DeepSeek-V4-Flash/a1b2c3d"
    pvc = one(docs, "PersistentVolumeClaim", f"{FULL}-models")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs"
    [job] = find(docs, "Job")
    assert job["metadata"]["name"].startswith(f"{FULL}-model-download-")
    spec = job["spec"]["template"]["spec"]
    c = spec["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert (env["REPO"]["value"], env["REVISION"]["value"], env["DEST"]["value"]) == (
        "deepseek-ai/DeepSeek-V4-Flash", "a1b2c3d", model_dir)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    compile(c["args"][0], "download", "exec")  # the script the Job runs is Python
    assert "snapshot_download" in c["args"][0] and ".v4serve-download-complete" in c["args"][0]
    assert {"name": "models", "mountPath": "/models"} in c["volumeMounts"]  # writable here only
    assert {"name": "models", "persistentVolumeClaim": {"claimName": f"{FULL}-models"}} in spec["volumes"]
    # every pod that reads the weights mounts the same claim read-only and waits for the mark
    readers = [(d["metadata"]["name"], t) for d in docs if d["kind"] != "Job" for _, t in pod_templates(d)
               if any(v["name"] == "models" for v in t["spec"].get("volumes", []))]
    assert len(readers) == 4  # pools owner, routers, prefill and decode groups
    for where, t in readers:
        volume = next(v for v in t["spec"]["volumes"] if v["name"] == "models")
        assert volume["persistentVolumeClaim"] == {"claimName": f"{FULL}-models", "readOnly": True}, where
        wait = t["spec"]["initContainers"][0]
        assert wait["name"] == "wait-for-model" and f"{model_dir}/.v4serve-download-complete" in wait["args"][0]
        assert job["metadata"]["name"] in wait["args"][0]
    assert f"--model={model_dir}" in pools_args(docs) and f"--model={model_dir}" in router_args(docs)
    mine = render(chart, CONFIGS["hf weights into your claim"])
    assert not find(mine, "PersistentVolumeClaim")
    assert one(mine, "Job", find(mine, "Job")[0]["metadata"]["name"])["spec"]["template"]["spec"]["volumes"][0][
        "persistentVolumeClaim"] == {"claimName": "shared-models"}
    assert "--model=/models/hf/org/tiny-v4/main" in pools_args(mine)


def test_worker_pod_extras(chart):
    docs = render(chart, CONFIGS["worker pod extras"])
    for role, t in workers(docs).items():
        spec, c = t["spec"], t["spec"]["containers"][0]
        assert t["metadata"]["annotations"] == {"k8s.v1.cni.cncf.io/networks": "rdma-net"}
        assert t["metadata"]["labels"]["team"] == "llm" and t["metadata"]["labels"]["v4serve.io/component"] == role
        assert (spec["runtimeClassName"], spec["schedulerName"]) == ("nvidia", "volcano")
        assert spec["priorityClassName"] == {"prefill": "serving-high", "decode": "serving-critical"}[role]
        assert spec["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
        assert spec["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "llm",
                                        "effect": "NoSchedule"}]
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in c["env"]
        assert {"name": "ib", "hostPath": {"path": "/dev/infiniband"}} in spec["volumes"]
        assert {"name": "ib", "mountPath": "/dev/infiniband"} in c["volumeMounts"]
    default = workers(render(chart, {}))["decode"]
    assert "annotations" not in default["metadata"] and "runtimeClassName" not in default["spec"]


def test_several_gpus_per_pod_run_one_worker_each(chart):
    docs = render(chart, CONFIGS["8 gpus per pod"])
    rc = one(docs, "RayCluster", FULL)
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    for role, pods in (("prefill", 1), ("decode", 2)):
        g = groups[role]
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == pods
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {role: 8}  # 8 worker slots a pod
        c = g["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        engine = {p["name"]: p["containerPort"] for p in c["ports"] if p["name"].startswith("engine-")}
        assert engine == {f"engine-{i}": 9400 + i for i in range(8)}
    args = pools_args(docs)
    assert {"--prefill=8", "--decode=16", "--gpus-per-worker=1", "--worker-metrics-port=9400",
            "--engine-stall-timeout=600"} <= set(args)
    ep = render(chart, CONFIGS["8 gpus per pod, one expert-parallel group"])
    assert {g["groupName"]: g["replicas"] for g in one(ep, "RayCluster", FULL)["spec"]["workerGroupSpecs"]} == {
        "prefill": 1, "decode": 1}
    assert {"--prefill-ep=8", "--decode-ep=8"} <= set(pools_args(ep))


def free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port > 65000:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_engine_liveness_probe_restarts_a_wedged_worker_only(chart):
    """The rendered probe command, run here against real worker endpoints: no worker listening yet
    and healthy workers pass; a worker whose step runs past its stall limit fails it."""
    from worker_runtime.engine_metrics import EngineStats, MetricsOptions, Sources, WorkerMetrics
    from worker_runtime.wire import WorkerLoad

    port = free_port_pair()
    docs = render(chart, {"serving": {"engineMetricsPort": port, "decode": 2}, "ray": {"decode": {"gpus": 2}}})
    probe = workers(docs)["decode"]["spec"]["containers"][0]["livenessProbe"]
    assert probe["failureThreshold"] == 3 and probe["periodSeconds"] == 30

    def run_probe() -> int:
        return subprocess.run(probe["exec"]["command"], timeout=60, check=False).returncode

    assert run_probe() == 0  # the pod is up, its workers are not created yet
    stats = [EngineStats(), EngineStats()]
    served = [WorkerMetrics(f"decode-{i}", "decode", MetricsOptions(port, host="127.0.0.1", stall_s=0.2), s,
                            Sources(lambda: WorkerLoad("decode-0", "decode"), dict)) for i, s in enumerate(stats)]
    try:
        urls = [m.serve("127.0.0.1") for m in served]
        assert urls[1].endswith(f":{port + 1}/metrics")  # the second worker of the pod took the next port
        assert run_probe() == 0
        stats[1].step_began()  # decode-1's step never returns
        time.sleep(0.3)
        assert run_probe() == 1
    finally:
        for m in served:
            m.stop()
    off = workers(render(chart, CONFIGS["monitoring and router autoscaling"]))["decode"]["spec"]["containers"][0]
    assert "livenessProbe" not in off


def test_read_only_root_filesystem_everywhere(chart):
    for name in ("default", "hf weights", "ray autoscaling", "keda"):
        for doc in render(chart, CONFIGS[name]):
            for where, t in pod_templates(doc):
                if where == f"{FULL}-redis":
                    continue
                for c in t["spec"]["containers"] + t["spec"].get("initContainers", []):
                    assert c["securityContext"]["readOnlyRootFilesystem"] is True, (name, where, c["name"])
                    if c["name"] != "wait-for-model":
                        assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, (name, where, c["name"])
            if doc["kind"] == "RayCluster" and doc["spec"].get("enableInTreeAutoscaling"):
                assert doc["spec"]["autoscalerOptions"]["securityContext"]["readOnlyRootFilesystem"] is True


def test_monitoring_objects_and_router_autoscaling(chart):
    docs = render(chart, CONFIGS["monitoring and router autoscaling"])
    pm = one(docs, "PodMonitor", f"{FULL}-workers")["spec"]
    assert one(docs, "PodMonitor", f"{FULL}-workers")["metadata"]["labels"]["release"] == "prom"
    for role, t in workers(docs).items():
        labels = t["metadata"]["labels"]
        assert pm["selector"]["matchLabels"].items() <= labels.items()
        assert labels["v4serve.io/component"] in pm["selector"]["matchExpressions"][0]["values"]
        ports = {p["name"] for p in t["spec"]["containers"][0]["ports"]}
        scraped = {e["port"] for e in pm["podMetricsEndpoints"]}
        assert {"engine-0", "metrics"} <= ports <= scraped, role
    # the routers and the pools owner are no worker pods
    for component in ("router", "pools"):
        labels = one(docs, "Deployment", f"{FULL}-{component}")["spec"]["template"]["metadata"]["labels"]
        assert labels["v4serve.io/component"] not in pm["selector"]["matchExpressions"][0]["values"]
    files = CHART / "files"
    rule = one(docs, "PrometheusRule", FULL)["spec"]
    assert rule["groups"] == yaml.safe_load((files / "v4serve-alerts.yaml").read_text())["groups"]
    dashboard = one(docs, "ConfigMap", f"{FULL}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["v4serve.json"]) == json.loads((files / "v4serve-dashboard.json").read_text())
    hpa = one(docs, "HorizontalPodAutoscaler", f"{FULL}-router")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-router"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert "replicas" not in one(docs, "Deployment", f"{FULL}-router")["spec"]  # the HPA owns it
    metrics_rule = one(docs, "NetworkPolicy", f"{FULL}-ray")["spec"]["ingress"][1]
    assert {"port": 9400, "endPort": 9415, "protocol": "TCP"} in metrics_rule["ports"]
    assert not find(render(chart, {}), "HorizontalPodAutoscaler")
