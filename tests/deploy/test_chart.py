"""The Helm chart deploy/helm/v4serve, rendered in-process by the real Helm engine (helm-python-sdk,
no helm binary, no network): for the default values and many non-default ones every rendered
object validates against the Kubernetes schemas (kubernetes-validate, strict: unknown fields are
errors) for the oldest and newest Kubernetes the chart supports, the RayCluster / ScaledObject /
ServiceMonitor objects against their CRD schemas (tests/deploy/crds/, hand-written minimal
subsets) with their pod templates validated as core/v1 PodTemplates; lint is clean; bad values
are refused by values.schema.json (or, for cross-field rules, by the templates) at install time;
the pools owner's and the routers' commands are what `v4serve up` and `v4serve router` accept,
with the settings they must share equal; any number of routers renders, behind one Service that
never sends clients to the pools owner."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "v4serve"
CRDS = Path(__file__).resolve().parent / "crds"
K8S_VERSIONS = ("1.27.0", "1.37.0")  # Chart.yaml kubeVersion floor, newest schemas shipped
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "raycluster.ray.io_v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.keda.sh_v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.monitoring.coreos.com_v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.monitoring.coreos.com_v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.monitoring.coreos.com_v1.json",
}
RELEASE, NAMESPACE = "prod", "serving"
FULL = f"{RELEASE}-v4serve"

CONFIGS = {
    "default": {},
    "external redis url": {"redis": {"mode": "external", "external": {"url": "rediss://:pw@redis.example:6380/2"}}},
    "external redis secret": {"redis": {"mode": "external", "external": {"existingSecret": "my-redis",
                                                                         "existingSecretKey": "url"}}},
    "hostPath weights": {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/nvme/models"},
                                   "path": "DeepSeek-V4-Flash"}},
    "rdma + hostNetwork": {"kvTransfer": {"rdma": {"enabled": True, "resourceName": "rdma/ib", "count": 2},
                                          "hostNetwork": True, "ucxTls": "rc,cuda_copy,cuda_ipc",
                                          "ucxNetDevices": "mlx5_0:1"}},
    "keda": {"autoscaling": {"mode": "keda", "decode": {"minReplicas": 1, "maxReplicas": 6}},
             "serviceMonitor": {"enabled": True}},
    "keda with auth ref": {"autoscaling": {"mode": "keda", "keda": {"authenticationRef": "prom-auth"}}},
    "ray autoscaling": {"autoscaling": {"mode": "ray", "prefill": {"minReplicas": 1, "maxReplicas": 3},
                                        "decode": {"minReplicas": 1, "maxReplicas": 8}}},
    "servicemonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus"}}},
    "tls": {"tls": {"enabled": True, "secretName": "v4serve-tls"},
            "serviceMonitor": {"enabled": True, "tlsInsecureSkipVerify": True}},
    "auth keys": {"auth": {"apiKeys": ["sk-aaaaaaaaaaaaaaaaaaaa", "sk-bbbbbbbbbbbbbbbbbbbb"]}},
    "auth existing secret": {"auth": {"existingSecret": "client-keys", "existingSecretKeys": ["team-a", "team-b", "c"]}},
    "no prefill pool": {"serving": {"prefill": 0, "decode": 2}},
    "expert-parallel prefill": {"serving": {"prefill": 4, "prefillEp": 2}},
    "expert-parallel decode on GPUs": {"serving": {"decode": 2, "decodeEp": 2, "device": "cuda"}},
    "per-pool overrides": {"serving": {"prefill": 8, "decode": 4},  # pods of 8 and 2 workers
                           "ray": {"workers": {"nodeSelector": {"gpu": "h200"}},
                                   "prefill": {"gpus": 8, "nodeSelector": {"gpu": "h100"}},
                                   "decode": {"gpus": 2, "shmSize": "128Gi"}}},
    "redis persistence": {"redis": {"internal": {"persistence": {"enabled": True, "storageClass": "fast"},
                                                 "password": "s3cret-pw"}}},
    "security objects off": {"networkPolicy": {"enabled": False}, "podDisruptionBudgets": {"enabled": False},
                             "auth": {"enabled": False}, "ray": {"auth": {"enabled": False}}},
    "load balancer": {"router": {"service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]}},
                      "networkPolicy": {"routerFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}},
    "one router": {"router": {"replicas": 1}, "podDisruptionBudgets": {"router": {"maxUnavailable": 0}}},
    "many routers": {"router": {"replicas": 6, "extraArgs": ["--remote-prefill-threshold=1024"],
                                "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                                    {"weight": 100, "podAffinityTerm": {
                                        "topologyKey": "kubernetes.io/hostname",
                                        "labelSelector": {"matchLabels": {"v4serve.io/component": "router"}}}}]}}},
                     "pools": {"nodeSelector": {"pool": "cpu"}, "podAnnotations": {"team": "serving"}}},
    "hf weights": {"model": {"source": "hf", "hf": {"uri": "hf://deepseek-ai/DeepSeek-V4-Flash@a1b2c3d",
                                                    "tokenSecret": "hf-token", "pvc": {"storageClass": "nfs"}}}},
    "hf weights into your claim": {"model": {"source": "hf", "hf": {"uri": "hf://org/tiny-v4",
                                                                    "pvc": {"existingClaim": "shared-models"}}}},
    "worker pod extras": {"ray": {"workers": {
        "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"}, "podLabels": {"team": "llm"},
        "runtimeClassName": "nvidia", "priorityClassName": "serving-high", "schedulerName": "volcano",
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"v4serve.io/component": "decode"}}}],
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "extraVolumes": [{"name": "ib", "hostPath": {"path": "/dev/infiniband"}}],
        "extraVolumeMounts": [{"name": "ib", "mountPath": "/dev/infiniband"}]},
        "decode": {"priorityClassName": "serving-critical"}}},
    "8 gpus per pod": {"serving": {"prefill": 8, "decode": 16}, "ray": {"workers": {"gpus": 8}},
                       "kvTransfer": {"rdma": {"enabled": True}}},
    "8 gpus per pod, one expert-parallel group": {"serving": {"prefill": 8, "prefillEp": 8, "decode": 8,
                                                              "decodeEp": 8}, "ray": {"workers": {"gpus": 8}}},
    "monitoring and router autoscaling": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True},
                                          "podMonitor": {"enabled": True, "labels": {"release": "prom"}},
                                          "prometheusRule": {"enabled": True},
                                          "router": {"autoscaling": {"enabled": True, "maxReplicas": 6}},
                                          "ray": {"workers": {"livenessProbe": {"enabled": False}}}},
}


# --- helpers ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as c:
        yield c


def render(chart, values) -> list[dict]:
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("namespace", NAMESPACE)
                docs.append(doc)
    return docs


def find(docs, kind, name=None):
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind, name):
    got = find(docs, kind, name)
    assert len(got) == 1, (kind, name, [(d["kind"], d["metadata"]["name"]) for d in docs])
    return got[0]


def pod_templates(doc) -> list[tuple[str, dict]]:
    """(where, PodTemplateSpec) of a workload or a RayCluster."""
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [(doc["metadata"]["name"], doc["spec"]["template"])]
    if doc["kind"] == "RayCluster":
        out = [("head", doc["spec"]["headGroupSpec"]["template"])]
        out += [(g["groupName"], g["template"]) for g in doc["spec"].get("workerGroupSpecs", [])]
        return out
    return []


def crd_validator(api_version, kind):
    schema = json.loads((CRDS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft202012Validator(schema)


def v4serve_args(docs, component: str) -> list[str]:
    """The `v4serve` arguments of the pools owner ("pools") or the routers ("router")."""
    container = one(docs, "Deployment", f"{FULL}-{component}")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/usr/bin/tini", "--", "/bin/sh", "-ec"]
    assert 'exec v4serve "$@"' in container["args"][0] and container["args"][1] == "v4serve"
    return container["args"][2:]


def router_args(docs) -> list[str]:
    return v4serve_args(docs, "router")


def pools_args(docs) -> list[str]:
    return v4serve_args(docs, "pools")


# --- every configuration: valid objects, clean lint -------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_renders_valid_kubernetes_objects(chart, name):
    docs = render(chart, CONFIGS[name])
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_SCHEMAS:
            errors = sorted(crd_validator(*key).iter_errors(doc), key=str)
            assert not errors, (name, doc["metadata"]["name"], [f"{list(e.path)}: {e.message}" for e in errors])
            for where, template in pod_templates(doc):  # the embedded pod templates are core/v1
                for version in K8S_VERSIONS:
                    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                                  "metadata": {"name": f"{doc['metadata']['name']}-{where}"},
                                                  "template": template}, version, strict=True)
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("name", CONFIGS)
def test_lint_is_clean(name):
    report = helm.lint(str(CHART), CONFIGS[name], strict=True, namespace=NAMESPACE)
    assert report["messages"] == [] and report["errors"] == [], report


@pytest.mark.parametrize("name", CONFIGS)
def test_every_container_requests_resources(chart, name):
    docs = render(chart, CONFIGS[name])
    for doc in docs:
        for where, template in pod_templates(doc):
            for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                requests = c.get("resources", {}).get("requests", {})
                assert {"cpu", "memory"} <= set(requests), (name, where, c["name"], requests)
        if doc["kind"] == "RayCluster" and doc["spec"].get("enableInTreeAutoscaling"):
            assert {"cpu", "memory"} <= set(doc["spec"]["autoscalerOptions"]["resources"]["requests"])


@pytest.mark.parametrize("name", CONFIGS)
def test_commands_are_what_v4serve_accepts(chart, name):
    """The rendered `v4serve up` (pools owner) and `v4serve router` arguments parse with the real
    CLI parser (argparse exits on an unknown flag), and what the two must share is equal: the
    checkpoint, the pools' name (registry prefix, Ray namespace), context length, keys, TLS."""
    from cluster.cli import _device_options, build_parser

    docs = render(chart, CONFIGS[name])
    up = build_parser().parse_args(pools_args(docs))
    router = build_parser().parse_args(router_args(docs))
    assert (up.command, router.command) == ("up", "router")
    shared = ("model", "cluster", "host", "http_port", "grpc_port", "max_model_len", "api_key", "tls_cert", "tls_key")
    assert {k: getattr(up, k) for k in shared} == {k: getattr(router, k) for k in shared}
    assert router.host == "0.0.0.0" and router.http_port == 8000 and router.grpc_port == 50051
    assert router.cluster == FULL
    assert _device_options(up)["device"] == up.device  # the device flags form a valid combination
    if "--remote-prefill-threshold=1024" not in router_args(docs):  # router.extraArgs may override it
        assert up.remote_prefill_threshold == router.remote_prefill_threshold


# --- what the default install contains ----------------------------------------------------------
def test_default_objects(chart):
    docs = render(chart, {})
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("Deployment", f"{FULL}-router"), ("Service", f"{FULL}-router"), ("Deployment", f"{FULL}-pools"),
        ("RayCluster", FULL),
        ("StatefulSet", f"{FULL}-redis"), ("Service", f"{FULL}-redis"), ("Service", f"{FULL}-redis-headless"),
        ("Secret", f"{FULL}-api-keys"), ("Secret", f"{FULL}-ray-token"), ("Secret", f"{FULL}-redis"),
        ("NetworkPolicy", f"{FULL}-router"), ("NetworkPolicy", f"{FULL}-ray"), ("NetworkPolicy", f"{FULL}-redis"),
        ("PodDisruptionBudget", f"{FULL}-router"), ("PodDisruptionBudget", f"{FULL}-pools"),
        ("PodDisruptionBudget", f"{FULL}-ray-head"),
        ("PodDisruptionBudget", f"{FULL}-prefill"), ("PodDisruptionBudget", f"{FULL}-decode"),
        ("PodDisruptionBudget", f"{FULL}-redis"),
        ("ServiceAccount", FULL),
    ])
    assert not find(docs, "ScaledObject") and not find(docs, "ServiceMonitor")


def test_raycluster_worker_groups(chart):
    docs = render(chart, {"serving": {"prefill": 4},
                          "ray": {"workers": {"nodeSelector": {"pool": "gpu"}}, "prefill": {"gpus": 4}}})
    rc = one(docs, "RayCluster", FULL)
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, g in groups.items():
        # KubeRay passes this to `ray start --resources=...`: one slot of the pool's resource per GPU
        gpus = "4" if role == "prefill" else "1"
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {role: int(gpus)}
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 1  # fixed size without autoscaling
        spec = g["template"]["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert spec["nodeSelector"] == {"pool": "gpu"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        models = next(v for v in spec["volumes"] if v["name"] == "models")
        assert models["persistentVolumeClaim"] == {"claimName": "v4serve-models", "readOnly": True}
        assert c["lifecycle"]["preStop"]["exec"]["command"] == ["python", "-m", "cluster.autoscale_actuator",
                                                                "drain-node", "--role", role]
        assert "hostNetwork" not in spec
        assert "IPC_LOCK" not in str(c["securityContext"])
    assert "enableInTreeAutoscaling" not in rc["spec"]


def test_rdma_and_host_network(chart):
    rc = one(render(chart, CONFIGS["rdma + hostNetwork"]), "RayCluster", FULL)
    for g in rc["spec"]["workerGroupSpecs"]:
        spec = g["template"]["spec"]
        c = spec["containers"][0]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert c["resources"]["limits"]["rdma/ib"] == c["resources"]["requests"]["rdma/ib"] == "2"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"] == "mlx5_0:1"


def test_hostpath_weights(chart):
    docs = render(chart, CONFIGS["hostPath weights"])
    assert "--model=/models/DeepSeek-V4-Flash" in router_args(docs)
    assert "--model=/models/DeepSeek-V4-Flash" in pools_args(docs)
    for doc in docs:
        for _, template in pod_templates(doc):
            for v in template["spec"].get("volumes", []):
                if v["name"] == "models":
                    assert v == {"name": "models", "hostPath": {"path": "/mnt/nvme/models", "type": "Directory"}}


def pod_spec(docs, component: str) -> dict:
    return one(docs, "Deployment", f"{FULL}-{component}")["spec"]["template"]["spec"]


def test_router_deployment(chart):
    docs = render(chart, {})
    dep = one(docs, "Deployment", f"{FULL}-router")
    assert dep["spec"]["replicas"] == 2  # a router can go (node drain, update) while the other serves
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    # ready once a decode worker is registered; alive while it answers, workers or not
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": "http", "scheme": "HTTP"}
    assert {p["containerPort"] for p in c["ports"]} == {8000, 50051}
    env = {e["name"]: e for e in c["env"]}
    assert env["REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@prod-v4serve-redis.serving.svc")
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-redis", "key": "redis-password"}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_HEAD_ADDRESS"]["value"] == f"{FULL}-head-svc.{NAMESPACE}.svc.cluster.local:6379"
    assert env["RAY_ADDRESS"]["value"] == "auto"
    assert pod["metadata"]["labels"]["v4serve.io/ray-member"] == "true"  # workers stream tokens back to it
    args = router_args(docs)
    assert args[0] == "router" and "--api-key=$(V4SERVE_API_KEY_0)" in args  # never the key itself
    assert not [a for a in args if a.split("=")[0] in ("--prefill", "--decode", "--autoscale")]
    svc = one(docs, "Service", f"{FULL}-router")
    assert {(p["name"], p["port"]) for p in svc["spec"]["ports"]} == {("http", 8000), ("grpc", 50051)}
    assert svc["spec"]["selector"] == {"v4serve.io/instance": RELEASE, "v4serve.io/component": "router"}


@pytest.mark.parametrize("serving, expected, absent", [
    ({"device": "cpu"}, {"--device=cpu"}, ("--gpus-per-worker", "--kernels", "--decode-graphs")),
    ({"kernels": "torch"}, {"--device=cuda", "--kernels=torch"}, ("--decode-graphs",)),
    ({"decodeGraphs": "none"}, {"--decode-graphs=none"}, ()),
])
def test_pools_device_flags(chart, serving, expected, absent):
    from cluster.cli import _device_options, build_parser

    args = pools_args(render(chart, {"serving": serving}))
    assert expected <= set(args) and not [a for a in args if absent and a.startswith(absent)]
    options = _device_options(build_parser().parse_args(args))  # a combination `up` accepts
    assert options["decode_graphs"] == ()  # none asked for, or not capturable


def test_pools_deployment(chart):
    docs = render(chart, {})
    dep = one(docs, "Deployment", f"{FULL}-pools")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert set(c) >= {"startupProbe", "livenessProbe"} and "readinessProbe" not in c
    for probe in ("startupProbe", "livenessProbe"):  # up to 30 min for the workers to load and register
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 1800
    assert pod["metadata"]["labels"]["v4serve.io/ray-member"] == "true"
    assert {e["name"] for e in c["env"]} == {e["name"] for e in pod_spec(docs, "router")["containers"][0]["env"]}
    args = pools_args(docs)
    assert args[0] == "up" and {"--prefill=1", "--decode=1", "--kv-dtype=fp8_pack", "--max-seqs=64"} <= set(args)
    # each worker serves from one GPU of its pod, through the kernels and decode graphs
    assert {"--device=cuda", "--gpus-per-worker=1", "--kernels=triton", "--decode-graphs=1,2,4,8,16,32,64"} <= set(args)
    # the Service's selector never matches the pools owner: clients only reach routers
    svc = one(docs, "Service", f"{FULL}-router")["spec"]["selector"]
    assert not svc.items() <= pod["metadata"]["labels"].items()


def test_router_replicas(chart):
    docs = render(chart, CONFIGS["many routers"])
    dep = one(docs, "Deployment", f"{FULL}-router")
    assert dep["spec"]["replicas"] == 6
    assert one(docs, "Deployment", f"{FULL}-pools")["spec"]["replicas"] == 1  # whatever the routers
    assert router_args(docs)[-1] == "--remote-prefill-threshold=1024"  # extraArgs last: they win
    assert pod_spec(docs, "router")["affinity"]["podAntiAffinity"]
    assert "affinity" not in pod_spec(docs, "pools") and pod_spec(docs, "pools")["nodeSelector"] == {"pool": "cpu"}
    assert one(docs, "Deployment", f"{FULL}-pools")["spec"]["template"]["metadata"]["annotations"] == {"team": "serving"}
    pdb = one(docs, "PodDisruptionBudget", f"{FULL}-router")["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"]["v4serve.io/component"] == "router"
    assert one(docs, "PodDisruptionBudget", f"{FULL}-pools")["spec"]["maxUnavailable"] == 0
    # one router: its PDB may forbid evictions
    docs = render(chart, CONFIGS["one router"])
    assert one(docs, "Deployment", f"{FULL}-router")["spec"]["replicas"] == 1
    assert one(docs, "PodDisruptionBudget", f"{FULL}-router")["spec"]["maxUnavailable"] == 0


def test_api_keys(chart):
    docs = render(chart, CONFIGS["auth keys"])
    secret = one(docs, "Secret", f"{FULL}-api-keys")
    assert sorted(secret["data"]) == ["api-key-0", "api-key-1"]
    for component in ("router", "pools"):  # the pools owner's own HTTP/gRPC is no open back door
        args = v4serve_args(docs, component)
        assert [a for a in args if a.startswith("--api-key")] == ["--api-key=$(V4SERVE_API_KEY_0)",
                                                                 "--api-key=$(V4SERVE_API_KEY_1)"]
        assert "sk-aaaa" not in json.dumps(one(docs, "Deployment", f"{FULL}-{component}"))
    docs = render(chart, CONFIGS["auth existing secret"])
    assert not find(docs, "Secret", f"{FULL}-api-keys")
    for component in ("router", "pools"):
        env = pod_spec(docs, component)["containers"][0]["env"]
        refs = [e["valueFrom"]["secretKeyRef"] for e in env if e["name"].startswith("V4SERVE_API_KEY_")]
        assert refs == [{"name": "client-keys", "key": k} for k in ("team-a", "team-b", "c")]
    docs = render(chart, {})  # no keys given: one is generated
    assert len(one(docs, "Secret", f"{FULL}-api-keys")["data"]["api-key"]) >= 48


def test_tls(chart):
    docs = render(chart, CONFIGS["tls"])
    for component, probe in (("router", "readinessProbe"), ("pools", "startupProbe")):
        c = pod_spec(docs, component)["containers"][0]
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"
        assert {"name": "tls", "mountPath": "/etc/v4serve/tls", "readOnly": True} in c["volumeMounts"]
        args = v4serve_args(docs, component)
        assert "--tls-cert=/etc/v4serve/tls/tls.crt" in args and "--tls-key=/etc/v4serve/tls/tls.key" in args
    sm = one(docs, "ServiceMonitor", f"{FULL}-router")
    assert sm["spec"]["endpoints"][0]["scheme"] == "https"


def test_external_redis(chart):
    docs = render(chart, CONFIGS["external redis url"])
    assert not find(docs, "StatefulSet") and not find(docs, "NetworkPolicy", f"{FULL}-redis")
    assert not find(docs, "PodDisruptionBudget", f"{FULL}-redis")
    for component in ("router", "pools"):
        env = {e["name"]: e for e in pod_spec(docs, component)["containers"][0]["env"]}
        assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-redis-url", "key": "redis-url"}
        assert "REDIS_PASSWORD" not in env
    docs = render(chart, CONFIGS["external redis secret"])
    for component in ("router", "pools"):
        env = {e["name"]: e for e in pod_spec(docs, component)["containers"][0]["env"]}
        assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "my-redis", "key": "url"}
    assert not find(docs, "Secret", f"{FULL}-redis-url")


def test_network_policies(chart):
    docs = render(chart, {})
    members = {"podSelector": {"matchLabels": {"v4serve.io/instance": RELEASE, "v4serve.io/ray-member": "true"}}}
    redis = one(docs, "NetworkPolicy", f"{FULL}-redis")["spec"]
    assert redis["ingress"] == [{"ports": [{"port": 6379, "protocol": "TCP"}], "from": [members]}]
    ray = one(docs, "NetworkPolicy", f"{FULL}-ray")["spec"]
    assert ray["podSelector"] == {"matchLabels": members["podSelector"]["matchLabels"]}
    assert ray["ingress"][0] == {"from": [members]}
    router = one(docs, "NetworkPolicy", f"{FULL}-router")["spec"]
    assert "from" not in router["ingress"][0]  # anyone may call the API (keys still apply)
    # ...of the routers: the pools owner is open to the Ray nodes only
    pools = one(docs, "Deployment", f"{FULL}-pools")["spec"]["template"]["metadata"]["labels"]
    selecting = [n["metadata"]["name"] for n in find(docs, "NetworkPolicy")
                 if n["spec"]["podSelector"]["matchLabels"].items() <= pools.items()]
    assert selecting == [f"{FULL}-ray"]
    # every pod that is a Ray node carries the member label the policies rely on
    for doc in docs:
        for where, template in pod_templates(doc):
            if where != f"{FULL}-redis":
                assert template["metadata"]["labels"]["v4serve.io/ray-member"] == "true", where
    router = one(render(chart, CONFIGS["load balancer"]), "NetworkPolicy", f"{FULL}-router")["spec"]
    assert router["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]


def test_pdbs_select_pods(chart):
    docs = render(chart, {})
    pods = [t["metadata"]["labels"] for d in docs for _, t in pod_templates(d)]
    for pdb in find(docs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= labels.items() for labels in pods), pdb["metadata"]["name"]


def test_ray_autoscaling(chart):
    from cluster.autoscaler import AutoscalerConfig

    docs = render(chart, CONFIGS["ray autoscaling"])
    rc = one(docs, "RayCluster", FULL)["spec"]
    assert rc["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in rc["workerGroupSpecs"]}
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"]) == (1, 3)
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (1, 8)
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in rc["autoscalerOptions"]["env"]
    cm = one(docs, "ConfigMap", f"{FULL}-autoscale")
    config = AutoscalerConfig.from_dict(json.loads(cm["data"]["autoscale.json"]))  # what the policy will read
    assert config.decode.max_replicas == 8 and config.decode.page_target == 0.85
    assert config.prefill.target == 8192 and config.prefill.down_cooldown_s == 120
    args = pools_args(docs)
    assert "--autoscale=policy" in args and "--autoscale-config=/etc/v4serve/autoscale/autoscale.json" in args
    pools = one(docs, "Deployment", f"{FULL}-pools")["spec"]["template"]
    assert {"name": "autoscale", "configMap": {"name": f"{FULL}-autoscale"}} in pools["spec"]["volumes"]
    assert "checksum/autoscale" in pools["metadata"]["annotations"]  # a policy change restarts the owner
    assert "--autoscale=policy" not in router_args(docs)


def test_keda(chart):
    docs = render(chart, CONFIGS["keda"])
    rc = one(docs, "RayCluster", FULL)["spec"]
    assert "workerGroupSpecs" not in rc  # the workers are Deployments KEDA can scale
    for role, (lo, hi) in {"prefill": (1, 4), "decode": (1, 6)}.items():
        dep = one(docs, "Deployment", f"{FULL}-{role}")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        script = c["args"][0]
        resources = next(a for a in shlex.split(script) if a.startswith("--resources="))
        assert json.loads(resources.split("=", 1)[1]) == {role: 1} and "--block" in script
        assert f"--address={FULL}-head-svc.{NAMESPACE}.svc.cluster.local:6379" in shlex.split(script)
        so = one(docs, "ScaledObject", f"{FULL}-{role}")["spec"]
        assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-{role}"}
        assert (so["minReplicaCount"], so["maxReplicaCount"]) == (lo, hi)
        trigger = so["triggers"][0]
        assert trigger["type"] == "prometheus"
        assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}
        # prefill on queued prefill tokens per worker, decode on waiting requests per worker
        metric, threshold = {"prefill": ("v4serve_queued_prefill_tokens", "8192"),
                             "decode": ("v4serve_queue_depth", "4")}[role]
        assert trigger["metadata"]["query"] == (f'max({metric}{{namespace="{NAMESPACE}",service="{FULL}-router",'
                                                f'pool="{role}"}}) or vector(0)')
        assert trigger["metadata"]["threshold"] == threshold and trigger["metricType"] == "AverageValue"
        if role == "decode":  # and page pressure, in workers' worth of pages, as the Ray policy
            pages = so["triggers"][1]
            sel = f'{{namespace="{NAMESPACE}",service="{FULL}-router",pool="decode"}}'
            assert pages["metadata"]["query"] == (f"(max(v4serve_kv_pages_in_use{sel}) / "
                                                  f"(max(v4serve_kv_pages_per_worker{sel}) > 0)) or vector(0)")
            assert pages["metadata"]["threshold"] == "0.85"
        else:
            assert len(so["triggers"]) == 1
        assert so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"][0]["value"] == 1
    assert "--autoscale=follow" in pools_args(docs)
    assert one(render(chart, CONFIGS["keda with auth ref"]), "ScaledObject", f"{FULL}-decode")["spec"]["triggers"][0][
        "authenticationRef"] == {"name": "prom-auth"}


def test_no_prefill_pool(chart):
    docs = render(chart, CONFIGS["no prefill pool"])
    groups = [g["groupName"] for g in one(docs, "RayCluster", FULL)["spec"]["workerGroupSpecs"]]
    assert groups == ["decode"]
    assert not find(docs, "PodDisruptionBudget", f"{FULL}-prefill")
    assert "--prefill=0" in pools_args(docs)


# --- bad values fail at install time ----------------------------------------------------------
BAD_VALUES = {
    "unknown top-level key": ({"routerr": {}}, "additional properties"),
    "zero router replicas": ({"router": {"replicas": 0}}, "/router/replicas"),
    "unknown model source": ({"model": {"source": "s3"}}, "/model/source"),
    "hostPath without a path": ({"model": {"source": "hostPath"}}, "/model"),
    "pvc without a claim": ({"model": {"pvc": {"claimName": ""}}}, "/model"),
    "bad kv dtype": ({"serving": {"kvDtype": "fp16"}}, "/serving/kvDtype"),
    "no decode workers": ({"serving": {"decode": 0}}, "/serving/decode"),
    "port out of range": ({"router": {"httpPort": 70000}}, "/router/httpPort"),
    "external redis without url": ({"redis": {"mode": "external"}}, "/redis/external"),
    "redis url not redis": ({"redis": {"mode": "external", "external": {"url": "http://x"}}}, "/redis/external/url"),
    "redis password not url-safe": ({"redis": {"internal": {"password": "a@b/c"}}}, "/redis/internal/password"),
    "tls without a secret": ({"tls": {"enabled": True}}, "/tls/secretName"),
    "short api key": ({"auth": {"apiKeys": ["short"]}}, "/auth/apiKeys/0"),
    "rdma count zero": ({"kvTransfer": {"rdma": {"enabled": True, "count": 0}}}, "/kvTransfer/rdma/count"),
    "unknown autoscaling mode": ({"autoscaling": {"mode": "hpa"}}, "/autoscaling/mode"),
    "decode min zero": ({"autoscaling": {"decode": {"minReplicas": 0, "maxReplicas": 2}}}, "/autoscaling/decode"),
    "page target above 1": ({"autoscaling": {"decode": {"minReplicas": 1, "maxReplicas": 2, "pageTarget": 1.5}}},
                            "pageTarget"),
    "cpu not a quantity": ({"router": {"resources": {"requests": {"cpu": "lots", "memory": "1Gi"}}}}, "cpu"),
    "requests without memory": ({"router": {"resources": {"requests": {"cpu": "1", "memory": None}}}}, "memory"),
    "gpus zero": ({"ray": {"workers": {"gpus": 0}}}, "/ray/workers/gpus"),
    "bad pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "bad servicemonitor interval": ({"serviceMonitor": {"enabled": True, "interval": "often"}}, "/serviceMonitor"),
    "pdb percentage typo": ({"podDisruptionBudgets": {"router": {"maxUnavailable": "50"}}}, "maxUnavailable"),
    "replicated pools owner": ({"pools": {"replicas": 2}}, "/pools"),  # one owner: there is no such key
    "pools owner without a cpu request": ({"pools": {"resources": {"requests": {"cpu": None, "memory": "1Gi"}}}},
                                          "/pools/resources"),
    "router extra args not strings": ({"router": {"extraArgs": [3]}}, "/router/extraArgs/0"),
    "unknown device": ({"serving": {"device": "tpu"}}, "/serving/device"),
    "decode graphs not batch sizes": ({"serving": {"decodeGraphs": "1,0"}}, "/serving/decodeGraphs"),
    "hf uri not hf": ({"model": {"source": "hf", "hf": {"uri": "s3://bucket/model"}}}, "/model/hf/uri"),
    "hf without a uri": ({"model": {"source": "hf"}}, "/model/hf"),
    "worker pod unknown field": ({"ray": {"decode": {"hostIPC": True}}}, "/ray/decode"),
    "spread constraint without a key": ({"ray": {"workers": {"topologySpreadConstraints": [{"maxSkew": 1}]}}},
                                        "topologySpreadConstraints"),
    "more than 16 gpus per pod": ({"ray": {"workers": {"gpus": 32}}}, "/ray/workers/gpus"),
    "engine port too low": ({"serving": {"engineMetricsPort": 80}}, "/serving/engineMetricsPort"),
    "keda threshold of the old name": ({"autoscaling": {"prefill": {"minReplicas": 1, "maxReplicas": 2,
                                                                    "queueDepthPerReplica": 8}}}, "/autoscaling/prefill"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_bad_values_rejected_by_schema(chart, name):
    values, where = BAD_VALUES[name]
    with pytest.raises(helm.HelmError) as err:
        chart.validate_schema(values)
    assert where in str(err.value), str(err.value)
    with pytest.raises(helm.HelmError):  # and rendering (what install does) refuses them too
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


# rules across fields, which JSON Schema cannot state: the templates refuse them with a message
BAD_COMBINATIONS = {
    "min above max": ({"autoscaling": {"mode": "ray", "decode": {"minReplicas": 4, "maxReplicas": 2}}},
                      "minReplicas (4) > maxReplicas (2)"),
    "start size outside bounds": ({"serving": {"decode": 5}, "autoscaling": {"mode": "ray"}},
                                  "serving.decode (5) must lie within"),
    "partial expert-parallel group": ({"serving": {"prefill": 3, "prefillEp": 2}},
                                      "serving.prefill (3) must be a multiple of serving.prefillEp (2)"),
    "expert-parallel prefill autoscaled": ({"serving": {"prefill": 2, "prefillEp": 2}, "autoscaling": {"mode": "ray"}},
                                           "serving.prefillEp > 1 needs autoscaling.mode none"),
    "partial expert-parallel decode group": ({"serving": {"decode": 3, "decodeEp": 2}},
                                             "serving.decode (3) must be a multiple of serving.decodeEp (2)"),
    "pool not a multiple of the gpus per pod": ({"serving": {"decode": 12}, "ray": {"decode": {"gpus": 8}}},
                                                "serving.decode (12) must be a multiple of ray.decode.gpus (8)"),
    "expert-parallel group across part of a pod": ({"serving": {"decode": 12, "decodeEp": 3},
                                                    "ray": {"decode": {"gpus": 4}}},
                                                   "an expert-parallel group must fill whole pods"),
    "several gpus per pod with keda": ({"serving": {"decode": 2}, "ray": {"decode": {"gpus": 2}},
                                        "autoscaling": {"mode": "keda"}}, "ray.decode.gpus > 1 needs"),
    "router autoscaling min above max": ({"router": {"autoscaling": {"enabled": True, "minReplicas": 9}}},
                                         "router.autoscaling: minReplicas (9) > maxReplicas (8)"),
    "expert-parallel decode autoscaled": ({"serving": {"decode": 2, "decodeEp": 2}, "autoscaling": {"mode": "ray"}},
                                          "serving.decodeEp > 1 needs autoscaling.mode none"),
}


@pytest.mark.parametrize("name", BAD_COMBINATIONS)
def test_bad_combinations_fail_rendering(chart, name):
    values, message = BAD_COMBINATIONS[name]
    chart.validate_schema(values)
    with pytest.raises(helm.HelmError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)


def test_defaults_document_every_key(chart):
    """values.yaml and values.schema.json agree: the defaults validate, and every default key is
    in the schema (additionalProperties is false everywhere the chart reads keys)."""
    chart.validate_schema({})
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(yaml.safe_load((CHART / "values.yaml").read_text())) == set(schema["properties"])
