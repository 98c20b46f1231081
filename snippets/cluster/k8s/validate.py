"""Check the course's Kubernetes manifests offline, before any cluster sees them.

    python -m snippets.cluster.k8s.validate snippets/cluster/k8s/*.yaml

Three layers, because no single tool covers a distributed training job:

1. Core resources (Service, Job, Pod templates) against the Kubernetes OpenAPI schema of one
   Kubernetes version, in strict mode: a misspelled field or a string where an integer goes is
   an error, as it would be for `kubectl apply --validate=strict`. The schemas ship inside the
   kubernetes-validate package, so this needs no cluster and no network.
2. The PyTorchJob custom resource against a small JSON schema written from the Kubeflow
   training operator's CRD (pytorchjob.schema.json beside this file); its pod templates go
   through layer 1 as core PodTemplates.
3. Cross-checks no schema can express: the torchrun command agrees with the job (nodes =
   completions, processes per node = GPUs requested), the master address is pod 0's DNS name
   under the headless Service, /dev/shm is RAM-backed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

K8S_VERSION = "1.33.0"  # the schema version the manifests are checked against
HERE = Path(__file__).resolve().parent


class ManifestError(ValueError):
    """A manifest is invalid; the message names the resource and the field."""


def load_manifests(path: str | Path) -> list[dict]:
    """Every YAML document in the file, in order (documents may be separated by ---)."""
    return [doc for doc in yaml.safe_load_all(Path(path).read_text()) if doc]


def _where(resource: dict) -> str:
    return f"{resource.get('kind', '?')}/{resource.get('metadata', {}).get('name', '?')}"


def _field(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


# --8<-- [start:schema]
def validate_core(resource: dict, version: str = K8S_VERSION) -> None:
    """A core Kubernetes resource against its OpenAPI schema, unknown fields rejected."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        raise ManifestError(f"{_where(resource)}: {_field(err)}: {err.message} "
                            f"(Kubernetes {version} schema, strict)") from None
    except kubernetes_validate.SchemaNotFoundError:
        raise ManifestError(f"{_where(resource)}: no schema for {resource.get('apiVersion')} "
                            f"{resource.get('kind')} in Kubernetes {version}") from None


def validate_pytorchjob(resource: dict) -> None:
    """The CRD's own fields against pytorchjob.schema.json, then each pod template as core."""
    import jsonschema

    schema = json.loads((HERE / "pytorchjob.schema.json").read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(resource),
                    key=lambda e: list(e.absolute_path))
    if errors:
        raise ManifestError(f"{_where(resource)}: {_field(errors[0])}: {errors[0].message} "
                            "(PyTorchJob kubeflow.org/v1 schema)")
    for role, replica in resource["spec"]["pytorchReplicaSpecs"].items():
        template = {"apiVersion": "v1", "kind": "PodTemplate",
                    "metadata": {"name": f"{resource['metadata']['name']}-{role.lower()}"},
                    "template": replica["template"]}
        validate_core(template)
# --8<-- [end:schema]


def _torchrun_flags(container: dict) -> dict[str, str]:
    words = " ".join(container.get("command", []) + container.get("args", [])).split()
    return dict(m.groups() for w in words if (m := re.match(r"^--([a-z_]+)=(\S+)$", w)))


def _gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def _check_shm(where: str, pod: dict) -> None:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for container in pod["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        volume = volumes.get(mounts.get("/dev/shm"), {})
        if volume.get("emptyDir", {}).get("medium") != "Memory":
            raise ManifestError(f"{where}: container {container['name']} has no RAM-backed "
                                "/dev/shm (an emptyDir with medium: Memory); the default 64 MiB "
                                "makes NCCL and DataLoader workers fail")


# --8<-- [start:cross-checks]
RDMA_RESOURCES = ("rdma/", "nvidia.com/hostdev")  # the shared device plugin's, host-device's
MULTUS = "k8s.v1.cni.cncf.io/networks"


def _check_rdma(where: str, template: dict) -> None:
    """A pod that asks for an RDMA device must be able to use it, or NCCL falls back to TCP."""
    pod = template["spec"]
    for container in pod["containers"]:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        limits = container.get("resources", {}).get("limits", {})
        if not any(name.startswith(RDMA_RESOURCES) for name in limits):
            continue
        added = container.get("securityContext", {}).get("capabilities", {}).get("add", [])
        if "IPC_LOCK" not in added:
            raise ManifestError(f"{where}: container {container['name']} asks for an RDMA device "
                                "without securityContext.capabilities.add: [IPC_LOCK]; RDMA "
                                "pins its buffers, which needs locked memory")
        if MULTUS not in template.get("metadata", {}).get("annotations", {}) and not pod.get(
                "hostNetwork"):
            raise ManifestError(f"{where}: container {container['name']} asks for an RDMA device "
                                f"but the pod has no network on the fabric: add the {MULTUS} "
                                "annotation (a Multus network) or hostNetwork: true")
        if env.get("NCCL_IB_DISABLE") == "1":
            raise ManifestError(f"{where}: container {container['name']} asks for an RDMA device "
                                "and sets NCCL_IB_DISABLE=1, which keeps NCCL on TCP")


def check_indexed_job(job: dict, service: dict) -> None:
    """The torchrun flags, the Job's shape and the headless Service must agree."""
    where, spec = _where(job), job["spec"]
    pod = spec["template"]["spec"]
    if spec.get("completionMode") != "Indexed":
        raise ManifestError(f"{where}: spec.completionMode must be Indexed: the completion "
                            "index is each pod's node rank")
    if spec["completions"] != spec.get("parallelism"):
        raise ManifestError(f"{where}: parallelism {spec.get('parallelism')} != completions "
                            f"{spec['completions']}: every node must run at the same time")
    if service["spec"].get("clusterIP") != "None" or pod.get("subdomain") != service["metadata"][
            "name"]:
        raise ManifestError(f"{where}: spec.template.spec.subdomain must name a headless "
                            f"Service (clusterIP: None); found {pod.get('subdomain')!r}")
    if service["spec"].get("selector") != {"job-name": job["metadata"]["name"]}:
        raise ManifestError(f"{_where(service)}: spec.selector must be "
                            f"{{job-name: {job['metadata']['name']}}} to select the Job's pods")
    container = pod["containers"][0]
    flags = _torchrun_flags(container)
    master = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    expected = {"nnodes": str(spec["completions"]), "nproc_per_node": str(_gpus(container)),
                "node_rank": "$(JOB_COMPLETION_INDEX)", "master_addr": master}
    for flag, value in expected.items():
        if flags.get(flag) != value:
            raise ManifestError(f"{where}: torchrun --{flag}={flags.get(flag)}, expected "
                                f"--{flag}={value}")
    _check_shm(where, pod)
    _check_rdma(where, spec["template"])


def check_pytorchjob(job: dict) -> None:
    where, specs = _where(job), job["spec"]["pytorchReplicaSpecs"]
    if specs["Master"]["replicas"] != 1:
        raise ManifestError(f"{where}: Master.replicas must be 1 (it is rank 0's node)")
    for role, replica in specs.items():
        pod = replica["template"]["spec"]
        names = [c["name"] for c in pod["containers"]]
        if "pytorch" not in names:
            raise ManifestError(f"{where}: {role} has containers {names}; the operator's "
                                "webhook rejects a replica without a container named 'pytorch' "
                                "(it reads the master port from that one)")
        gpus = _gpus(pod["containers"][names.index("pytorch")])
        if job["spec"].get("nprocPerNode") != str(gpus):
            raise ManifestError(f"{where}: nprocPerNode {job['spec'].get('nprocPerNode')!r} "
                                f"but {role} asks for {gpus} GPUs: one process per GPU")
        _check_shm(f"{where} {role}", pod)
        _check_rdma(f"{where} {role}", replica["template"])
# --8<-- [end:cross-checks]


def validate_file(path: str | Path) -> list[str]:
    """Validate every resource in the file; return one line per resource that passed."""
    resources = load_manifests(path)
    by_kind = {r.get("kind"): r for r in resources}
    passed = []
    for resource in resources:
        if resource.get("kind") == "PyTorchJob":
            validate_pytorchjob(resource)
            check_pytorchjob(resource)
            how = "kubeflow.org/v1 CRD schema + pod templates + cross-checks"
        else:
            validate_core(resource)
            how = f"Kubernetes {K8S_VERSION} schema, strict"
            if resource.get("kind") == "Job" and "Service" in by_kind:
                check_indexed_job(resource, by_kind["Service"])
                how += " + cross-checks"
        passed.append(f"ok  {Path(path).name}: {_where(resource)} ({how})")
    return passed


def main(argv=None) -> int:
    from snippets.flags import Parser

    p = Parser(description="Validate Kubernetes manifests against the Job and PyTorchJob "
                           "schemas and the course's cross-checks.")
    p.add_argument("paths", nargs="*", help=f"YAML files (default: every one in {HERE.name}/)")
    paths = p.parse_args(argv).paths or sorted(HERE.glob("*.yaml"))
    status = 0
    for path in paths:
        try:
            print("\n".join(validate_file(path)))
        except ManifestError as err:
            print(f"FAIL {Path(path).name}: {err}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
