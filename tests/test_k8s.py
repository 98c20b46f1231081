"""The Kubernetes manifests validate offline against the Kubernetes schema (strict), the PyTorchJob
CRD schema and the cross-checks; broken copies of them are rejected with the field named."""

import copy
import io
from pathlib import Path

import pytest

from snippets.cluster.k8s.validate import (ManifestError, check_indexed_job, check_pytorchjob,
                                           load_manifests, validate_core, validate_file,
                                           validate_pytorchjob)

pytestmark = pytest.mark.kernel_independent("YAML manifests against schemas")

K8S = Path(__file__).resolve().parents[1] / "snippets" / "cluster" / "k8s"


def test_manifests_are_valid():
    lines = validate_file(K8S / "indexed-job.yaml") + validate_file(K8S / "pytorchjob.yaml")
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == [
        "Service/train-gpt", "Job/train-gpt", "PyTorchJob/train-gpt"]


# --8<-- [start:broken]
def broken_job(edit):
    service, job = load_manifests(K8S / "indexed-job.yaml")
    job = copy.deepcopy(job)
    edit(job["spec"])
    return service, job


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.update(completion=s.pop("completions")),  # misspelled field
     r"spec: Additional properties are not allowed \('completion' was unexpected\)"),
    (lambda s: s.update(completions="2"),  # a string where an integer goes
     r"spec.completions: '2' is not of type 'integer'"),
    (lambda s: s["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="29500"),
     r"spec.template.spec.containers.0.ports.0.containerPort: '29500' is not of type 'integer'"),
    (lambda s: s["template"]["spec"]["tolerations"][0].update(operator=True),
     r"tolerations.0.operator: True is not of type 'string'"),
])
def test_schema_rejects_broken_job(edit, message):
    _, job = broken_job(edit)
    with pytest.raises(ManifestError, match=message):
        validate_core(job)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.update(parallelism=1), r"parallelism 1 != completions 2"),
    (lambda s: s["template"]["spec"].update(subdomain="trainer"), r"subdomain must name"),
    (lambda s: s["template"]["spec"]["containers"][0]["resources"]["limits"].update(
        {"nvidia.com/gpu": 4}), r"--nproc_per_node=8, expected --nproc_per_node=4"),
    (lambda s: s["template"]["spec"]["volumes"][0]["emptyDir"].pop("medium"), r"/dev/shm"),
])
def test_cross_checks_reject_inconsistent_job(edit, message):
    service, job = broken_job(edit)
    validate_core(job)  # each of these is valid Kubernetes, and still a broken training job
    with pytest.raises(ManifestError, match=message):
        check_indexed_job(job, service)
# --8<-- [end:broken]


def test_pytorchjob_schema_and_checks_reject_mistakes():
    (job,) = load_manifests(K8S / "pytorchjob.yaml")
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replica"] = 1
    with pytest.raises(ManifestError, match=r"Worker: Additional properties.*'replica'"):
        validate_pytorchjob(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["nprocPerNode"] = 8  # an integer where the v1 API wants a string
    with pytest.raises(ManifestError, match=r"spec.nprocPerNode: 8 is not of type 'string'"):
        validate_pytorchjob(bad)
    bad = copy.deepcopy(job)
    container = bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")  # the pod template's own schema
    with pytest.raises(ManifestError, match=r"PodTemplate/train-gpt-master: template.spec."
                       r"containers.0: Additional properties .*'volumeMount'"):
        validate_pytorchjob(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = \
        "trainer"
    with pytest.raises(ManifestError, match=r"named 'pytorch'"):
        check_pytorchjob(bad)


# --8<-- [start:dockerfile]
DOCKERFILE_INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "CMD",
                           "ENTRYPOINT", "EXPOSE", "LABEL", "VOLUME", "SHELL", "HEALTHCHECK",
                           "STOPSIGNAL", "ONBUILD"}


def test_gpu_dockerfile_parses_and_pins_torch_first():
    from dockerfile_parse import DockerfileParser

    text = (K8S.parent / "Dockerfile").read_text()
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    steps = [s for s in parser.structure if s["instruction"] != "COMMENT"]
    unknown = [s["instruction"] for s in steps if s["instruction"] not in DOCKERFILE_INSTRUCTIONS]
    assert not unknown, f"not Dockerfile instructions: {unknown}"
    assert parser.baseimage.startswith("nvidia/cuda:13.0") and "devel" in parser.baseimage
    pip = [s["value"] for s in steps if s["instruction"] == "RUN" and "pip install" in s["value"]]
    # torch is installed first and pinned; everything after goes through constraints.txt, so no
    # later package can replace it (the same rule as the Makefile's).
    assert pip[0] == "pip install torch==2.13.0"
    assert all("-c constraints.txt" in cmd for cmd in pip[1:]) and len(pip) == 2
    copies = [s["value"] for s in steps if s["instruction"] == "COPY"]
    assert all(Path(src).exists() for c in copies for src in c.split()[:-1]), copies
    assert parser.envs["DS_BUILD_OPS"] == "0"
    assert steps[-1]["instruction"] == "CMD" and "USER" in [s["instruction"] for s in steps]
    # The manifests run the image this Dockerfile's header says to build.
    tag = "registry.example.com/course/train:torch2.13.0-cuda13.0"
    assert f"-t {tag}" in text
    for manifest in ("indexed-job.yaml", "pytorchjob.yaml"):
        assert f"image: {tag}" in (K8S / manifest).read_text()
# --8<-- [end:dockerfile]


def without_rdma(job: dict) -> dict:
    """The RDMA manifest with its four additions taken out again."""
    job = copy.deepcopy(job)
    job["metadata"]["name"] = "train-gpt"
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        template = replica["template"]
        del template["metadata"]
        container = template["spec"]["containers"][0]
        del container["securityContext"]
        del container["resources"]["limits"]["rdma/rdma_shared_device_a"]
        container["env"] = [{"name": "NCCL_DEBUG", "value": "WARN"}]
    return job


def test_rdma_job_is_the_tcp_job_plus_its_rdma_parts():
    """The RDMA variant validates, and differs from pytorchjob.yaml only by what RDMA needs
    (device, IPC_LOCK, fabric network, NCCL variables): the two files cannot drift apart."""
    assert validate_file(K8S / "pytorchjob-rdma.yaml")[0].startswith(
        "ok  pytorchjob-rdma.yaml: PyTorchJob/train-gpt-rdma")
    (rdma,) = load_manifests(K8S / "pytorchjob-rdma.yaml")
    (tcp,) = load_manifests(K8S / "pytorchjob.yaml")
    assert without_rdma(rdma) == tcp


def rdma_edit(edit):
    (job,) = load_manifests(K8S / "pytorchjob-rdma.yaml")
    edit(job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    return job


@pytest.mark.parametrize("edit,message", [
    (lambda t: t["spec"]["containers"][0].pop("securityContext"), r"Worker: .*\[IPC_LOCK\]"),
    (lambda t: t.pop("metadata"), r"Worker: .*no network on the fabric"),
    (lambda t: t["spec"]["containers"][0]["env"].append({"name": "NCCL_IB_DISABLE", "value": "1"}),
     r"Worker: .*NCCL_IB_DISABLE=1"),
])
def test_an_rdma_request_nccl_could_not_use_is_refused(edit, message):
    job = rdma_edit(edit)
    validate_pytorchjob(job)  # valid Kubernetes: NCCL would quietly run over TCP
    with pytest.raises(ManifestError, match=message):
        check_pytorchjob(job)


def test_host_network_is_a_fabric_network_too():
    def host_network(template):
        del template["metadata"]
        template["spec"]["hostNetwork"] = True

    check_pytorchjob(rdma_edit(host_network))
